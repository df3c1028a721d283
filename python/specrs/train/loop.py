"""The training loop the head trainers share (eagle3.py, mlp_speculator.py): one pass per epoch
over the feature cache shard by shard, AdamW with linear warmup and cosine decay, gradient
clipping, bfloat16 autocast, a tqdm progress bar, and a checkpoint every `save_every` steps that a
stopped run resumes from.

Invariant: the conversation trained at step s depends only on the seed and s (each epoch's order
comes from seed + epoch), so a resumed run trains on exactly what an unbroken run would have.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from .features import Shards


def fit(name: str, model: torch.nn.Module, shards: Shards, train_ids: list[int],
        step_loss: Callable[[int, int], torch.Tensor | None], args: argparse.Namespace, clip: float) -> dict:
    """Trains `model` for `args.epochs` passes over `train_ids`; `step_loss(i, step)` is conversation
    i's loss at training step `step` (None when it has nothing to learn; a loss that draws at random
    seeds its draws with the step, so a resumed run draws what an unbroken one would). Returns
    {"steps", "seconds", "last_loss"}."""
    if not train_ids:
        raise SystemExit(f"{args.features} has no conversation to train on (all {len(shards.items)} held out)")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step = state["step"]
    total_steps = int(args.epochs * len(train_ids))  # 0: evaluate only (e.g. a head before fine-tuning)
    t0 = time.perf_counter()
    order, order_epoch = [], -1
    smoothed = None
    bar = tqdm(total=total_steps, initial=step, desc=name, file=sys.stderr, mininterval=10, dynamic_ncols=True)
    while step < total_steps:
        epoch = step // len(train_ids)
        if epoch != order_epoch:
            order, order_epoch = shards.order(train_ids, np.random.default_rng(args.seed + epoch)), epoch
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = step_loss(order[step % len(train_ids)], step)
        if loss is not None:
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            value = float(loss.detach())
            smoothed = value if smoothed is None else 0.98 * smoothed + 0.02 * value
            bar.set_postfix(loss=f"{smoothed:.3f}", lr=f"{lr:.1e}", refresh=False)
        step += 1
        bar.update(1)
        if step % args.save_every == 0 or step == total_steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    bar.close()
    return {"steps": total_steps, "seconds": round(time.perf_counter() - t0, 1), "last_loss": smoothed}


def conversation_tensors(shards: Shards, i: int, with_taps: bool) -> tuple[torch.Tensor | None, ...]:
    """Conversation i of the cache as tensors: tokens int64, loss mask, taps float32 (None unless
    `with_taps`: the MLP speculator reads only the final hidden state) and final float32."""
    tokens, mask, taps, final = shards.get(i)
    return (torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(np.asarray(mask)),
            torch.from_numpy(taps.astype(np.float32)) if with_taps else None,
            torch.from_numpy(final.astype(np.float32)))


def simulate_greedy_drafting(agree: list[np.ndarray], first_anchor: int, end: int) -> tuple[int, int]:
    """(accepted draft tokens, drafts) of greedy chain drafting over one greedy conversation, from
    teacher-forced agreement: `agree[j][a]` says whether draft step j from anchor a is the target's
    token. Drafting starts at `first_anchor` (the first anchor after the prompt's prefill), accepts
    the leading run of right steps, and moves past the accepted tokens and the target's own one,
    as speculative decoding does; anchors from `end` on have no full chain. Averaging agreement
    over every anchor instead overstates acceptance: the anchors after a miss are the hard ones."""
    accepted = drafts = 0
    anchor = first_anchor
    while anchor < end:
        run = 0
        while run < len(agree) and anchor < len(agree[run]) and agree[run][anchor]:
            run += 1
        accepted += run
        drafts += 1
        anchor += run + 1
    return accepted, drafts
