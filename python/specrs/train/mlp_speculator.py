"""Trains IBM's MLP speculator (Wertheimer et al. 2024, arXiv 2404.19124) on cached target features
(features.py) and writes it in the format fms-extras, vLLM and specrs load (`{"method":
"mlp_speculator", "model": DIR}`). Needs torch (the `train` extra: `pip install torch gguf tqdm`).

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

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:
    raise SystemExit("specrs train-head mlp_speculator needs torch: pip install torch gguf tqdm (the train extra)") from e

from .features import Shards, split
from . import arguments as command_lines
from .loop import conversation_tensors, fit, simulate_greedy_drafting
from .safetensors import read_safetensors, write_safetensors


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


def rows_and_inputs(model: MlpSpeculator, tokens, mask, final):
    """Row t: state final[t], tokens x[t+1..], sub-head i drafts x[t+2+i] (response positions only);
    None when the conversation has no such row."""
    n = tokens.shape[0] - 1 - model.n_predict
    if n <= 0:
        return None
    rows = torch.arange(n)
    rows = rows[mask[rows + 1]]  # position t + 1 predicts a response token
    if len(rows) == 0:
        return None
    return rows, model(final[rows], [tokens[rows + 1 + i] for i in range(model.n_predict)])


def loss(model: MlpSpeculator, tokens, mask, final) -> torch.Tensor | None:
    """Mean cross-entropy of the sub-heads against the tokens the target wrote."""
    out = rows_and_inputs(model, tokens, mask, final)
    if out is None:
        return None
    rows, logits = out
    return sum(F.cross_entropy(lg.float(), tokens[rows + 2 + i]) for i, lg in enumerate(logits)) / model.n_predict


@torch.no_grad()
def evaluate(model: MlpSpeculator, shards: Shards, ids: list[int]) -> dict:
    """Teacher-forced on held-out conversations (their tokens are the target's greedy or sampled
    ones): the loss, top-1 per sub-head, and the mean acceptance length of greedy chain drafting
    replayed over them (loop.simulate_greedy_drafting: exact where the conversation is greedy)."""
    correct, counted = np.zeros(model.n_predict), np.zeros(model.n_predict)
    accepted, anchors, loss_sum, loss_count = 0, 0, 0.0, 0
    for i in ids:
        tokens, mask, _, final = conversation_tensors(shards, i, with_taps=False)
        out = rows_and_inputs(model, tokens, mask, final)
        if out is None:
            continue
        rows, logits = out
        loss_sum += float(sum(F.cross_entropy(lg.float(), tokens[rows + 2 + j]) for j, lg in enumerate(logits)))
        loss_count += model.n_predict
        agree = []  # per sub-head j: whether its draft from anchor t (row t) is right, over all t
        for j, lg in enumerate(logits):
            ok = lg.argmax(-1) == tokens[rows + 2 + j]
            correct[j] += int(ok.sum())
            counted[j] += len(rows)
            agree.append(np.zeros(len(tokens), dtype=bool))
            agree[-1][rows.numpy()] = ok.numpy()
        response = np.flatnonzero(mask.numpy())
        a, d = simulate_greedy_drafting(agree, int(response[0]), int(response[-1]))
        accepted, anchors = accepted + a, anchors + d
    return {"conversations": len(ids), "loss": round(loss_sum / max(loss_count, 1), 4),
            "top1_per_head": (correct / np.maximum(counted, 1)).round(4).tolist(),
            "mean_acceptance_length": round(1 + accepted / max(anchors, 1), 4)}


def write_ibm(model: MlpSpeculator, out_dir: str, hidden: int, vocab: int, inner: int) -> None:
    os.makedirs(out_dir, exist_ok=True)
    w = lambda t: t.detach().cpu().numpy().astype(np.float32)  # noqa: E731
    # Tied: only the shared tensors (emb, head, ln of sub-head 0; proj 0 and 1), as the parameters
    # of a tied model are named in vLLM and fms-extras: a third of the bytes of every copy.
    tensors = {"speculator.proj.0.weight": w(model.proj0.weight), "speculator.emb.0.weight": w(model.emb.weight),
               "speculator.head.0.weight": w(model.head.weight), "speculator.ln.0.weight": w(model.ln_weight),
               "speculator.ln.0.bias": w(model.ln_bias)}
    if model.n_predict > 1:
        tensors["speculator.proj.1.weight"] = w(model.proj1.weight)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
                   "vocab_size": vocab, "emb_dim": hidden, "inner_dim": inner, "n_predict": model.n_predict,
                   "top_k_tokens_per_head": [1] * model.n_predict, "n_candidates": 1, "tie_weights": True,
                   "scale_input": True}, f, indent=1)


def read_ibm(head_dir: str) -> tuple[dict, dict[str, np.ndarray]]:
    config = json.load(open(os.path.join(head_dir, "config.json")))
    return config, read_safetensors(os.path.join(head_dir, "model.safetensors"))


def build(args: argparse.Namespace, hidden: int) -> MlpSpeculator:
    """A new tied speculator shaped by `args`, or the one in `args.init` to fine-tune."""
    if args.init is None:
        return MlpSpeculator(hidden, args.vocab, args.inner, args.n_predict)
    config, tensors = read_ibm(args.init)
    if not config.get("tie_weights"):
        raise SystemExit(f"{args.init}: only tied MLP speculators (tie_weights: true) can be fine-tuned here")
    model = MlpSpeculator(config["emb_dim"], config["vocab_size"], config["inner_dim"], config["n_predict"])
    p = "speculator." if "speculator.emb.0.weight" in tensors else ""
    state = {"proj0.weight": f"{p}proj.0.weight", "proj1.weight": f"{p}proj.1.weight", "emb.weight": f"{p}emb.0.weight",
             "ln_weight": f"{p}ln.0.weight", "ln_bias": f"{p}ln.0.bias", "head.weight": f"{p}head.0.weight"}
    model.load_state_dict({k: torch.from_numpy(np.array(tensors[v], dtype=np.float32)) for k, v in state.items()})
    return model


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    shards = Shards(args.features)
    hidden = shards.get(0)[3].shape[1]
    model = build(args, hidden)
    train_ids, held_out = split(shards.lines, args.held_out)
    before = evaluate(model, shards, held_out) if args.init is not None and held_out else None

    def step_loss(i: int, _step: int) -> torch.Tensor | None:
        tokens, mask, _, final = conversation_tensors(shards, i, with_taps=False)
        return loss(model, tokens, mask, final)

    report = fit("mlp_speculator", model, shards, train_ids, step_loss, args, clip=1.0)
    write_ibm(model, args.out, hidden, model.head.weight.shape[0], model.head.weight.shape[1])
    report["train_tokens"] = int(sum(shards.items[i][2] - shards.items[i][1] for i in train_ids))
    if held_out:
        report["held_out"] = evaluate(model, shards, held_out)
    if before is not None:
        report["held_out_before"] = before
    return report


def arguments() -> argparse.ArgumentParser:
    return command_lines.mlp_speculator()


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(train(arguments().parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
