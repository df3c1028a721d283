"""Trains a DFlash block drafter (block diffusion, arXiv 2602.06036) on cached target features
(features.py) and writes it as PyPI dflash 0.1.0's DFlashDraftModel directory, which specrs loads
(`{"method": "dflash", "model": DIR}`). Needs torch (the `train` extra: `pip install torch gguf tqdm`).

The drafter (what crates/specrs-core/src/proposer/heads/dflash.rs runs): the target's hidden
states at the feature cache's three tapped layers (EAGLE-3's; `target_layer_ids` = those layers
minus one, since dflash taps a layer's output), concatenated, through `fc` and `hidden_norm` into
one context row per position; `--layers` Qwen3 decoder layers whose keys and values are the
context rows' (each layer its own projections) and the block's; a block of `--block-size` rows, the
newest token then `mask_token_id` (by default the token the cache's responses use least), embedded
with the target's frozen table; after `norm`, the target's frozen LM head. Block rows attend to the
context before the newest token and to each other both ways.

Training (facts from the DFlash paper; none of its code): per conversation, `--anchors` random
response positions each open a block as drafting would there (the context is every position
before the anchor); row j is trained with soft cross-entropy against the target's own distribution
for the token at anchor + j (recomputed from the cached final hidden state and the LM head), row
weights decaying as `--decay`^(j - 1), since a later row only counts when every earlier one was
accepted. AdamW with warmup and cosine decay, clipping at 1.0, checkpoints and resuming as the
other trainers (loop.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # the training extra is optional: say how to get it
    raise SystemExit("specrs train-head dflash needs torch: pip install torch gguf tqdm (the train extra)") from e

from . import arguments as command_lines
from .eagle3 import rope, target_weights
from .features import Shards, split
from .loop import conversation_tensors, fit, simulate_greedy_drafting
from .safetensors import write_safetensors


class DFlashLayer(torch.nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        h, f, nh, nkv, hd = s["hidden"], s["ffn"], s["heads"], s["kv_heads"], s["head_dim"]
        lin = lambda o, i: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.s = s
        self.input_norm, self.post_norm = torch.nn.Parameter(torch.ones(h)), torch.nn.Parameter(torch.ones(h))
        self.q, self.k, self.v, self.o = lin(nh * hd, h), lin(nkv * hd, h), lin(nkv * hd, h), lin(h, nh * hd)
        self.q_norm, self.k_norm = torch.nn.Parameter(torch.ones(hd)), torch.nn.Parameter(torch.ones(hd))
        self.gate, self.up, self.down = lin(f, h), lin(f, h), lin(h, f)

    def heads(self, proj: torch.nn.Linear, x: torch.Tensor, n: int, norm: torch.Tensor | None,
              positions: torch.Tensor | None) -> torch.Tensor:
        """`x` `[T, H]` -> `[n, T, head_dim]`, q/k-normed and rotated at `positions` `[T]` where asked."""
        y = proj(x).unflatten(-1, (n, self.s["head_dim"])).transpose(0, 1)
        if norm is not None:
            y = rms(y, norm, self.s["eps"])
        return y if positions is None else rope(y, positions, self.s["theta"])

    def block_heads(self, proj: torch.nn.Linear, x: torch.Tensor, n: int, norm: torch.Tensor | None,
                    positions: torch.Tensor | None) -> torch.Tensor:
        """Blocks `x` `[N, B, H]` at `positions` `[N, B]` -> `[N, n, B, head_dim]`."""
        N, B = x.shape[:2]
        flat = self.heads(proj, x.reshape(N * B, -1), n, norm, None if positions is None else positions.reshape(-1))
        return flat.unflatten(1, (N, B)).transpose(0, 1)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, block_positions: torch.Tensor,
                ctx_visible: torch.Tensor) -> torch.Tensor:
        """Blocks `x` `[N, B, H]` at `block_positions` `[N, B]` over context rows `ctx` `[T, H]`
        (positions 0..T-1); `ctx_visible` `[N, T]` says which context rows each block sees."""
        s = self.s
        nh, nkv = s["heads"], s["kv_heads"]
        rep = nh // nkv
        xn = rms(x, self.input_norm, s["eps"])
        q = self.block_heads(self.q, xn, nh, self.q_norm, block_positions)  # [N, heads, B, hd]
        k_blk = self.block_heads(self.k, xn, nkv, self.k_norm, block_positions)  # [N, kv, B, hd]
        v_blk = self.block_heads(self.v, xn, nkv, None, None)
        ctx_positions = torch.arange(ctx.shape[0])
        k_ctx = self.heads(self.k, ctx, nkv, self.k_norm, ctx_positions)  # [kv, T, hd]
        v_ctx = self.heads(self.v, ctx, nkv, None, None)
        k_blk, v_blk = k_blk.repeat_interleave(rep, 1), v_blk.repeat_interleave(rep, 1)  # [N, heads, B, hd]
        k_ctx, v_ctx = k_ctx.repeat_interleave(rep, 0), v_ctx.repeat_interleave(rep, 0)  # [heads, T, hd]
        scale = 1.0 / math.sqrt(s["head_dim"])
        scores_ctx = torch.einsum("nhbd,htd->nhbt", q, k_ctx) * scale
        scores_ctx = scores_ctx.masked_fill(~ctx_visible[:, None, None, :], float("-inf"))
        scores_blk = torch.einsum("nhbd,nhcd->nhbc", q, k_blk) * scale
        weights = torch.softmax(torch.cat([scores_ctx, scores_blk], -1).float(), -1).to(q.dtype)
        T = ctx.shape[0]
        attn = torch.einsum("nhbt,htd->nhbd", weights[..., :T], v_ctx) + weights[..., T:] @ v_blk
        x = x + self.o(attn.transpose(1, 2).flatten(-2))
        y = rms(x, self.post_norm, s["eps"])
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class DFlashDrafter(torch.nn.Module):
    def __init__(self, shape: dict, embedding: np.ndarray, target_lm_head: np.ndarray):
        super().__init__()
        h = shape["hidden"]
        self.shape = shape
        self.fc = torch.nn.Linear(shape["num_taps"] * h, h, bias=False)
        self.hidden_norm, self.norm = torch.nn.Parameter(torch.ones(h)), torch.nn.Parameter(torch.ones(h))
        self.layers = torch.nn.ModuleList([DFlashLayer(shape) for _ in range(shape["num_layers"])])
        self.register_buffer("embedding", torch.from_numpy(embedding), persistent=False)
        self.register_buffer("target_lm_head", torch.from_numpy(target_lm_head), persistent=False)

    def blocks(self, tokens: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Normed outputs `[N, B - 1, H]` of the blocks opened at `anchors` `[N]` (the newest
        token's position; the context is every position before it): row j drafts anchor + j + 1."""
        s = self.shape
        T = tokens.shape[0]
        ctx = rms(self.fc(taps.reshape(T, -1)), self.hidden_norm, s["eps"])  # [T, H]
        block = torch.full((anchors.shape[0], s["block"]), s["mask_token_id"], dtype=torch.long)
        block[:, 0] = tokens[anchors]
        x = self.embedding[block]  # [N, B, H]
        positions = anchors[:, None] + torch.arange(s["block"])[None, :]
        visible = torch.arange(T)[None, :] < anchors[:, None]  # [N, T]
        for layer in self.layers:
            x = layer(x, ctx, positions, visible)
        return rms(x[:, 1:], self.norm, s["eps"])

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return out @ self.target_lm_head.T


def anchors_of(mask: torch.Tensor, count: int | None, rng: np.random.Generator | None) -> torch.Tensor:
    """Positions a that open a block in the response: a >= 1 (some context) and position a predicts
    a response token (the block's first draft, at a + 1). `count` of them at random, or all."""
    valid = np.flatnonzero(mask.numpy()[1:]) + 1
    if count is not None and len(valid) > count:
        valid = np.sort(rng.choice(valid, count, replace=False))
    return torch.from_numpy(valid.astype(np.int64))


def rows_of(anchors: torch.Tensor, block: int, length: int) -> torch.Tensor:
    """`[N, B - 1]` the position whose final hidden state gives row j's target distribution (anchor + j,
    for the token at anchor + j + 1), clamped into the conversation (rows past its end are masked)."""
    return (anchors[:, None] + torch.arange(block - 1)[None, :]).clamp(max=length - 1)


def losses(drafter: DFlashDrafter, tokens, mask, taps, final, anchors: torch.Tensor, decay: float):
    """Soft cross-entropy of every block row against the target's distribution, weighted
    decay^(j - 1) by row, on rows whose token is a response token; None without any."""
    if anchors.numel() == 0:
        return None
    B, T = drafter.shape["block"], tokens.shape[0]
    rows = rows_of(anchors, B, T)
    valid = mask[rows] & ((anchors[:, None] + torch.arange(B - 1)[None, :]) < T - 1)
    if not valid.any():
        return None
    out = drafter.blocks(tokens, taps, anchors)
    p = torch.softmax((final[rows[valid]] @ drafter.target_lm_head.T).float(), -1)
    logq = torch.log_softmax(drafter.logits(out[valid]).float(), -1)
    weights = (decay ** torch.arange(B - 1, dtype=torch.float32))[None, :].expand_as(valid)[valid]
    return (weights * -(p * logq).sum(-1)).sum() / weights.sum()


@torch.no_grad()
def greedy_agreement(drafter: DFlashDrafter, tokens, mask, taps, final, chunk: int = 64) -> list[np.ndarray]:
    """Per block row j, `[T]` bool over anchors a: whether row j's greedy token is the target's
    greedy token at a + j + 1 (a response token). Blocks are independent of the tokens drafted in
    them, so this is exactly what greedy verification accepts row by row from anchor a."""
    B, T = drafter.shape["block"], tokens.shape[0]
    target_argmax = (final @ drafter.target_lm_head.T).argmax(-1)  # [T]: the token at position + 1
    agree = [np.zeros(T, dtype=bool) for _ in range(B - 1)]
    anchors = anchors_of(mask, None, None)
    for start in range(0, anchors.numel(), chunk):
        a = anchors[start:start + chunk]
        drafted = drafter.logits(drafter.blocks(tokens, taps, a)).argmax(-1)  # [n, B - 1]
        rows = rows_of(a, B, T)
        ok = (drafted == target_argmax[rows]) & mask[rows] & ((a[:, None] + torch.arange(B - 1)[None, :]) < T - 1)
        for j in range(B - 1):
            agree[j][a.numpy()] = ok[:, j].numpy()
    return agree


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, shards: Shards, ids: list[int], decay: float) -> dict:
    """On held-out conversations: the loss over every anchor, top-1 per block row, and the mean
    acceptance length (accepted drafts + the target's own token) of greedy drafting with the whole
    block replayed over them (loop.simulate_greedy_drafting)."""
    B = drafter.shape["block"]
    correct, counted = np.zeros(B - 1), np.zeros(B - 1)
    accepted, drafts, loss_sum, loss_count = 0, 0, 0.0, 0
    for i in ids:
        tokens, mask, taps, final = conversation_tensors(shards, i, with_taps=True)
        loss = losses(drafter, tokens, mask, taps, final, anchors_of(mask, None, None), decay)
        if loss is not None:
            loss_sum, loss_count = loss_sum + float(loss), loss_count + 1
        agree = greedy_agreement(drafter, tokens, mask, taps, final)
        anchors = anchors_of(mask, None, None).numpy()
        T = tokens.shape[0]
        for j, ok in enumerate(agree):
            countable = anchors[anchors + j < T - 1]
            countable = countable[mask.numpy()[countable + j]]
            correct[j] += int(ok[countable].sum())
            counted[j] += len(countable)
        response = np.flatnonzero(mask.numpy())
        if len(response) > 0:
            # The prefill wrote the first response token (position response[0] + 1): the first
            # block opens there; the last response token opens none worth replaying.
            a, d = simulate_greedy_drafting(agree, int(response[0]) + 1, int(response[-1]) + 1)
            accepted, drafts = accepted + a, drafts + d
    return {"conversations": len(ids), "loss": round(loss_sum / max(loss_count, 1), 4),
            "top1_per_position": (correct / np.maximum(counted, 1)).round(4).tolist(),
            "mean_acceptance_length": round(1 + accepted / max(drafts, 1), 4)}


# dflash's tensor names of one layer's parameters.
LAYER_NAMES = {
    "input_layernorm.weight": "input_norm", "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_proj.weight": "q.weight", "self_attn.k_proj.weight": "k.weight",
    "self_attn.v_proj.weight": "v.weight", "self_attn.o_proj.weight": "o.weight",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate.weight", "mlp.up_proj.weight": "up.weight", "mlp.down_proj.weight": "down.weight",
}


def write_dflash(drafter: DFlashDrafter, out_dir: str, tap_layers: list[int], num_target_layers: int,
                 vocab: int) -> None:
    """dflash's DFlashDraftModel directory: config.json (a Qwen3 config with num_target_layers and
    dflash_config) + model.safetensors (float32)."""
    os.makedirs(out_dir, exist_ok=True)
    s = drafter.shape
    w = lambda t: t.detach().cpu().numpy().astype(np.float32)  # noqa: E731
    state = drafter.state_dict()
    tensors = {"fc.weight": w(state["fc.weight"]), "hidden_norm.weight": w(state["hidden_norm"]),
               "norm.weight": w(state["norm"])}
    for i in range(s["num_layers"]):
        tensors |= {f"layers.{i}.{name}": w(state[f"layers.{i}.{attr}"]) for name, attr in LAYER_NAMES.items()}
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": s["hidden"],
                   "intermediate_size": s["ffn"], "num_hidden_layers": s["num_layers"],
                   "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
                   "head_dim": s["head_dim"], "rms_norm_eps": s["eps"], "rope_theta": s["theta"],
                   "vocab_size": vocab, "max_position_embeddings": 8192, "tie_word_embeddings": False,
                   "num_target_layers": num_target_layers,
                   "dflash_config": {"target_layer_ids": [layer - 1 for layer in tap_layers],
                                     "block_size": s["block"], "mask_token_id": s["mask_token_id"]}}, f, indent=1)


def target_num_layers(path: str) -> int:
    """The target's decoder block count, from its GGUF metadata or Hugging Face config.json
    (dflash's config records it: `num_target_layers`)."""
    if os.path.isdir(path):
        return int(json.load(open(os.path.join(path, "config.json")))["num_hidden_layers"])
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    return int(fields[f"{arch}.block_count"].parts[-1][0])


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    shards = Shards(args.features)
    embedding, lm_head = target_weights(args.target)
    vocab, hidden = embedding.shape
    tap_layers = shards.index["layers"]
    mask_token_id = args.mask_token_id
    if mask_token_id is None:  # the token the responses use least: its embedding means "unknown"
        mask_token_id = int(np.argmin(shards.token_counts(vocab)))
    shape = dict(hidden=hidden, heads=args.heads, kv_heads=args.kv_heads, head_dim=hidden // args.heads,
                 ffn=args.ffn, eps=1e-5, theta=args.rope_theta, num_layers=args.layers, block=args.block_size,
                 num_taps=len(tap_layers), mask_token_id=mask_token_id)
    drafter = DFlashDrafter(shape, embedding, lm_head)
    train_ids, held_out = split(shards.lines, args.held_out)

    def step_loss(i: int, step: int):
        tokens, mask, taps, final = conversation_tensors(shards, i, with_taps=True)
        anchors = anchors_of(mask, args.anchors, np.random.default_rng([args.seed, step]))
        return losses(drafter, tokens, mask, taps, final, anchors, args.decay)

    report = fit("dflash", drafter, shards, train_ids, step_loss, args, clip=1.0)
    write_dflash(drafter, args.out, tap_layers, target_num_layers(args.target), vocab)
    report["mask_token_id"] = mask_token_id
    report["train_tokens"] = int(sum(shards.items[i][2] - shards.items[i][1] for i in train_ids))
    if held_out:
        report["held_out"] = evaluate(drafter, shards, held_out, args.decay)
    return report


def arguments() -> argparse.ArgumentParser:
    return command_lines.dflash()


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(train(arguments().parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
