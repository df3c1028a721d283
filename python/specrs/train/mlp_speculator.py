"""Trains IBM's MLP speculator (Wertheimer et al. 2024, arXiv 2404.19124) on cached target features
(features.py) and writes it in the format fms-extras, vLLM and specrs load (`{"method":
"mlp_speculator", "model": DIR}`). Needs torch (`pip install 'specrs[train]'`).

The head (crates/specrs-core/src/proposer/heads/mlp_speculator.rs): sub-head i turns the running
state s and the token before the one it drafts into s' = GELU(ln_i(proj_i(s) + (emb_weight /
state_weight) * emb_i(token))) and logits head_i(s'); the first state is the target's final-normed
hidden state at the position before the newest token (weightless RMS norm, divided by sqrt(2):
`scale_input`). With `tie_weights` every sub-head shares emb, ln and head, and sub-heads 2.. share
proj (what keeps a 49k-vocabulary head small).

Training: teacher forcing on the conversations' own next tokens (the target wrote them), cross-
entropy per sub-head, on response positions only; AdamW with warmup and cosine decay.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:
    raise SystemExit("specrs.train.mlp_speculator needs torch: pip install 'specrs[train]'") from e

from .eagle3 import Shards, write_safetensors


class MlpSpeculator(torch.nn.Module):
    def __init__(self, hidden: int, vocab: int, inner: int, n_predict: int):
        super().__init__()
        self.n_predict = n_predict
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * inner / 2)
        self.proj0 = torch.nn.Linear(hidden, inner, bias=False)
        self.proj1 = torch.nn.Linear(inner, inner, bias=False)
        self.emb = torch.nn.Embedding(vocab, inner)
        self.ln_weight = torch.nn.Parameter(torch.ones(inner))
        self.ln_bias = torch.nn.Parameter(torch.zeros(inner))
        self.head = torch.nn.Linear(inner, vocab, bias=False)
        torch.nn.init.normal_(self.emb.weight, std=1 / math.sqrt(inner))

    def forward(self, state: torch.Tensor, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """Logits of each sub-head; `state` `[n, hidden]`, `tokens[i]` `[n]` the token before draft i."""
        s = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
        out = []
        for i, tok in enumerate(tokens):
            z = (self.proj0 if i == 0 else self.proj1)(s) + (self.emb_weight / self.state_weight) * self.emb(tok)
            z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * self.ln_weight + self.ln_bias
            s = F.gelu(z)
            out.append(self.head(s))
        return out


def loss_and_stats(model: MlpSpeculator, tokens, mask, final):
    """Row t: state final[t], tokens x[t+1..], sub-head i drafts x[t+2+i] (response positions only)."""
    T = tokens.shape[0]
    n = T - 1 - model.n_predict
    if n <= 0:
        return None, []
    rows = torch.arange(n)
    valid = mask[rows + 1]  # position t + 1 predicts a response token
    if not valid.any():
        return None, []
    rows = rows[valid]
    logits = model(final[rows], [tokens[rows + 1 + i] for i in range(model.n_predict)])
    total, stats = 0.0, []
    for i, lg in enumerate(logits):
        target = tokens[rows + 2 + i]
        total = total + F.cross_entropy(lg, target)
        stats.append((int((lg.argmax(-1) == target).sum()), len(target)))
    return total / model.n_predict, stats


def write_ibm(model: MlpSpeculator, out_dir: str, hidden: int, vocab: int, inner: int) -> None:
    os.makedirs(out_dir, exist_ok=True)
    w = lambda t: t.detach().cpu().numpy().astype(np.float32)  # noqa: E731
    tensors = {"speculator.proj.0.weight": w(model.proj0.weight)}
    for i in range(model.n_predict):
        tensors |= {f"speculator.emb.{i}.weight": w(model.emb.weight), f"speculator.head.{i}.weight":
                    w(model.head.weight), f"speculator.ln.{i}.weight": w(model.ln_weight),
                    f"speculator.ln.{i}.bias": w(model.ln_bias)}
        if i >= 1:
            tensors[f"speculator.proj.{i}.weight"] = w(model.proj1.weight)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
                   "vocab_size": vocab, "emb_dim": hidden, "inner_dim": inner, "n_predict": model.n_predict,
                   "top_k_tokens_per_head": [1] * model.n_predict, "n_candidates": 1, "tie_weights": True,
                   "scale_input": True}, f, indent=1)


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    shards = Shards(args.features)
    _, _, _, final0 = shards.get(0)
    hidden = final0.shape[1]
    model = MlpSpeculator(hidden, args.vocab, args.inner, args.n_predict)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    n = len(shards.items)
    held_out = set(range(0, n, max(2, round(1 / args.held_out))))
    train_ids = [i for i in range(n) if i not in held_out]
    total_steps = int(args.epochs * len(train_ids))
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    for step in range(total_steps):
        tokens, mask, _, final = (torch.from_numpy(np.asarray(a)) for a in shards.get(train_ids[rng.integers(len(train_ids))]))
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, _ = loss_and_stats(model, tokens.long(), mask, final.float())
        if loss is None:
            continue
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.log_every == 0:
            print(f"mlp_speculator: step {step + 1}/{total_steps} loss {float(loss.detach()):.3f} "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    write_ibm(model, args.out, hidden, args.vocab, args.inner)
    correct, counted = np.zeros(args.n_predict), np.zeros(args.n_predict)
    with torch.no_grad():
        for i in sorted(held_out):
            tokens, mask, _, final = (torch.from_numpy(np.asarray(a)) for a in shards.get(i))
            _, stats = loss_and_stats(model, tokens.long(), mask, final.float())
            for j, (c, k) in enumerate(stats):
                correct[j] += c
                counted[j] += k
    return {"held_out_conversations": len(held_out), "top1_per_head": (correct / np.maximum(counted, 1)).round(4).tolist()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab", type=int, default=49152, help="the target's vocabulary size")
    parser.add_argument("--inner", type=int, default=256)
    parser.add_argument("--n-predict", type=int, default=3)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--held-out", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    print(json.dumps(train(parser.parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
