"""Trains an EAGLE-3 head (Li et al. 2025, arXiv 2503.01840) on cached target features
(features.py) and writes it in speculators' format, which specrs, vLLM and SGLang load
(`{"method": "eagle3", "model": DIR}`). Needs torch (the `train` extra: `pip install torch gguf tqdm`).

The head (what crates/specrs-core/src/proposer/heads/eagle.rs runs): `fc` maps the target's
three tapped hidden states `[3H]` to `[H]`; one Llama decoder layer whose attention reads
`[input_layernorm(embed(token)); hidden_norm(fc out)]` `[2H]`, with the fc output as its residual;
`norm`, then an LM head over a draft vocabulary (the `draft_vocab_size` most frequent response
tokens), mapped to target ids by `d2t`. The embedding is the target's, frozen. `--fc-norm` adds
an RMSNorm per tapped layer before `fc` (speculators' `fc_norm`), for targets such as Gemma 3
whose tapped layers differ in scale by orders of magnitude.

Training (facts from the EAGLE-3 paper, SpecForge and speculators, no code from them):
- Soft cross-entropy against the target's own distribution restricted to the draft vocabulary
  (recomputed from the cached final hidden state and the target's LM head rows of the draft
  vocabulary, so the full 49k-wide softmax never runs).
- Training-time test over `ttt_steps` steps: step 0 reads the target's taps; step j feeds the
  step j-1 output back as the hidden state at position i + j, with the true next token, attending
  to step-0 rows up to i and to its own chain, as drafting does; step j's loss is weighted 0.8^j.
- Loss only where the target wrote the next token (the response), AdamW with warmup and cosine
  decay, gradient clipping at 0.5. Checkpoints every `save_every` steps; a run resumes from one.
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
    raise SystemExit("specrs train-head eagle3 needs torch: pip install torch gguf tqdm (the train extra)") from e

from .features import Shards, split
from . import arguments as command_lines
from .loop import conversation_tensors, fit, simulate_greedy_drafting
from .safetensors import read_safetensors, write_safetensors


def target_weights(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(embedding, LM head), each `[vocab, hidden]` float32, of the target at `path` (a GGUF file,
    or a Hugging Face directory with model.safetensors), dequantized; the same array twice when the
    LM head is tied (SmolLM2, Gemma 3). The head reads tokens through the embedding; the target's
    distribution is recomputed from the LM head."""
    if os.path.isdir(path):
        tensors = read_safetensors(os.path.join(path, "model.safetensors"))
        embedding = tensors["model.embed_tokens.weight"].astype(np.float32)
        lm_head = tensors.get("lm_head.weight")
        return embedding, (embedding if lm_head is None else lm_head.astype(np.float32))
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    if "token_embd.weight" not in tensors:
        raise SystemExit(f"{path} has no token_embd.weight")

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(int(t.shape[1]), int(t.shape[0]))

    embedding = read("token_embd.weight")
    return embedding, (read("output.weight") if "output.weight" in tensors else embedding)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (transformers' Llama) over `x` `[heads, T, head_dim]`."""
    half = x.shape[-1] // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions.float()[:, None] * inv[None, :]
    cos, sin = torch.cos(angles), torch.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Eagle3Head(torch.nn.Module):
    def __init__(self, shape: dict, draft_ids: np.ndarray, embedding: np.ndarray, target_lm_head: np.ndarray):
        super().__init__()
        h, f = shape["hidden"], shape["ffn"]
        self.shape = shape
        nh, nkv, hd = shape["heads"], shape["kv_heads"], shape["head_dim"]
        lin = lambda o, i: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = lin(h, 3 * h)
        # speculators' `fc_norm`: an RMSNorm per tapped layer before fc, so a target whose layers
        # differ in scale by orders of magnitude (Gemma 3's residual stream passes 1e4) feeds fc
        # comparable inputs.
        self.fc_norms = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(h)) for _ in range(3)]
                                               if shape.get("fc_norm") else [])
        self.hidden_norm = torch.nn.Parameter(torch.ones(h))
        self.input_norm = torch.nn.Parameter(torch.ones(h))
        self.q, self.k, self.v, self.o = lin(nh * hd, 2 * h), lin(nkv * hd, 2 * h), lin(nkv * hd, 2 * h), lin(h, nh * hd)
        self.post_norm = torch.nn.Parameter(torch.ones(h))
        self.gate, self.up, self.down = lin(f, h), lin(f, h), lin(h, f)
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.register_buffer("embedding", torch.from_numpy(embedding), persistent=False)
        self.register_buffer("target_lm_head", torch.from_numpy(target_lm_head), persistent=False)
        self.register_buffer("draft_ids", torch.from_numpy(draft_ids.astype(np.int64)), persistent=False)
        self.lm_head = lin(len(draft_ids), h)
        with torch.no_grad():  # start from the target's own LM head rows
            self.lm_head.weight.copy_(self.target_lm_head[self.draft_ids])

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.shape["eps"]) * w

    def qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        s = self.shape
        x = torch.cat([self.rms(self.embedding[tokens], self.input_norm), self.rms(hidden, self.hidden_norm)], -1)
        T = x.shape[0]
        q = self.q(x).view(T, s["heads"], s["head_dim"]).transpose(0, 1)
        k = self.k(x).view(T, s["kv_heads"], s["head_dim"]).transpose(0, 1)
        v = self.v(x).view(T, s["kv_heads"], s["head_dim"]).transpose(0, 1)
        rep = s["heads"] // s["kv_heads"]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        return rope(q, positions, s["theta"]), rope(k, positions, s["theta"]), v

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        T = residual.shape[0]
        x = residual + self.o(attn.transpose(0, 1).reshape(T, -1))
        y = self.rms(x, self.post_norm)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.rms(out, self.norm))

    def ttt(self, tokens: torch.Tensor, taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Outputs `[T - j - 1, H]` of every step j: row i of step j drafts the token at i + j + 2."""
        T = tokens.shape[0]
        scale = 1.0 / math.sqrt(self.shape["head_dim"])
        if len(self.fc_norms) > 0:
            taps = torch.stack([self.rms(taps[:, k], w) for k, w in enumerate(self.fc_norms)], 1)
        hidden = self.fc(taps.reshape(T, -1))
        positions = torch.arange(T)
        q0, k0, v0 = self.qkv(tokens[1:], hidden[:-1], positions[:-1])
        n = T - 1
        causal = torch.full((n, n), float("-inf")).triu(1)
        attn = torch.softmax(q0 @ k0.transpose(1, 2) * scale + causal, -1) @ v0
        out = self.finish(attn, hidden[:-1])
        outs = [out]
        chain_k, chain_v = [k0], [v0]  # per step, row i of step s at position i + s
        for j in range(1, steps):
            n = T - 1 - j
            if n <= 0:
                break
            q, k, v = self.qkv(tokens[1 + j:], outs[-1][:n], positions[j:j + n])
            chain_k.append(k)
            chain_v.append(v)
            s0 = q @ k0[:, :n].transpose(1, 2) * scale + causal[:n, :n]
            diag = torch.stack([(q * ck[:, :n]).sum(-1) * scale for ck in chain_k[1:]], -1)
            weights = torch.softmax(torch.cat([s0, diag], -1), -1)
            attn = weights[..., :n] @ v0[:, :n]
            for s, cv in enumerate(chain_v[1:]):
                attn = attn + weights[..., n + s:n + s + 1] * cv[:, :n]
            outs.append(self.finish(attn, outs[-1][:n]))
        return outs


def losses(head: Eagle3Head, tokens, mask, taps, final, steps: int) -> torch.Tensor | None:
    """One conversation's loss: soft cross-entropy against the target's distribution over the draft
    vocabulary at every TTT step, weighted 0.8^j, on response positions; None when it has none."""
    outs = head.ttt(tokens, taps, steps)
    target_logits = final @ head.target_lm_head[head.draft_ids].T  # [T, draft_vocab]
    total = None
    for j, out in enumerate(outs):
        rows = slice(1 + j, 1 + j + out.shape[0])  # the target's distribution for the drafted token
        valid = mask[rows]
        if not valid.any():
            continue
        p = torch.softmax(target_logits[rows][valid].float(), -1)
        logq = torch.log_softmax(head.logits(out[valid]).float(), -1)
        term = (0.8 ** j) * -(p * logq).sum(-1).mean()
        total = term if total is None else total + term
    return total


@torch.no_grad()
def greedy_agreement(head: Eagle3Head, tokens, mask, taps, final, steps: int) -> list[torch.Tensor]:
    """Per TTT step j, `[T - 1 - j]` bool: whether the head's draft from anchor i (mapped to target
    ids) is the target's greedy token over its whole vocabulary, on response positions. While
    every earlier draft of a chain was right its inputs are exactly what drafting feeds, so the
    leading run of True from an anchor is the number of drafts greedy verification accepts there."""
    outs = head.ttt(tokens, taps, steps)
    target_argmax = (final @ head.target_lm_head.T).argmax(-1)  # [T]
    agree = []
    for j, out in enumerate(outs):
        rows = slice(1 + j, 1 + j + out.shape[0])
        drafted = head.draft_ids[head.logits(out).argmax(-1)]
        agree.append((drafted == target_argmax[rows]) & mask[rows])
    return agree


def write_speculators(head: Eagle3Head, out_dir: str, layers: list[int], vocab: int) -> None:
    """speculators' EAGLE-3 directory: config.json + model.safetensors (float32)."""
    os.makedirs(out_dir, exist_ok=True)
    s = head.shape
    w = lambda t: t.detach().cpu().numpy().astype(np.float32)  # noqa: E731
    state = head.state_dict()
    tensors = {name: w(state[attr]) for name, attr in NAMES.items()}
    tensors |= {f"fc_norm.{k}.weight": w(p) for k, p in enumerate(head.fc_norms)}
    tensors["d2t"] = (head.draft_ids.numpy() - np.arange(len(head.draft_ids))).astype(np.int64)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    layer = {"model_type": "llama", "hidden_size": s["hidden"], "num_attention_heads": s["heads"],
             "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "intermediate_size": s["ffn"],
             "vocab_size": vocab, "rms_norm_eps": s["eps"], "rope_theta": s["theta"],
             "max_position_embeddings": 8192, "num_hidden_layers": 1}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
                   "transformer_layer_config": layer, "draft_vocab_size": len(head.draft_ids),
                   "norm_before_residual": False, "fc_norm": len(head.fc_norms) > 0,
                   "eagle_aux_hidden_state_layer_ids": layers,
                   "speculators_config": {"algorithm": "eagle3"}}, f, indent=1)


# speculators' tensor names of the head's parameters (write_speculators and read_speculators).
NAMES = {
    "fc.weight": "fc.weight", "layers.0.hidden_norm.weight": "hidden_norm",
    "layers.0.input_layernorm.weight": "input_norm", "layers.0.self_attn.q_proj.weight": "q.weight",
    "layers.0.self_attn.k_proj.weight": "k.weight", "layers.0.self_attn.v_proj.weight": "v.weight",
    "layers.0.self_attn.o_proj.weight": "o.weight", "layers.0.post_attention_layernorm.weight": "post_norm",
    "layers.0.mlp.gate_proj.weight": "gate.weight", "layers.0.mlp.up_proj.weight": "up.weight",
    "layers.0.mlp.down_proj.weight": "down.weight", "norm.weight": "norm", "lm_head.weight": "lm_head.weight",
}


def read_speculators(head_dir: str) -> tuple[dict, np.ndarray, dict[str, np.ndarray]]:
    """(config, draft_ids, tensors) of an EAGLE-3 head directory in speculators' format."""
    config = json.load(open(os.path.join(head_dir, "config.json")))
    tensors = read_safetensors(os.path.join(head_dir, "model.safetensors"))
    draft_ids = np.arange(len(tensors["d2t"])) + tensors["d2t"]
    return config, draft_ids, tensors


def build(args: argparse.Namespace, shards: Shards, embedding: np.ndarray, lm_head: np.ndarray) -> Eagle3Head:
    """A new head shaped by `args` (draft vocabulary: the most frequent response tokens of the
    cache), or the head of `args.init` to fine-tune, with its own shape and draft vocabulary."""
    vocab, hidden = embedding.shape
    shape = dict(hidden=hidden, heads=args.heads, kv_heads=args.kv_heads, head_dim=hidden // args.heads,
                 ffn=args.ffn, eps=1e-5, theta=args.rope_theta, fc_norm=args.fc_norm)
    if args.init is None:
        counts = shards.token_counts(vocab)
        draft_ids = np.sort(np.argsort(-counts, kind="stable")[: args.draft_vocab])
        return Eagle3Head(shape, draft_ids, embedding, lm_head)
    config, draft_ids, tensors = read_speculators(args.init)
    layer = config["transformer_layer_config"]
    shape.update(heads=layer["num_attention_heads"], kv_heads=layer["num_key_value_heads"],
                 head_dim=layer.get("head_dim", hidden // layer["num_attention_heads"]),
                 ffn=layer["intermediate_size"], eps=layer.get("rms_norm_eps", 1e-5),
                 theta=layer.get("rope_theta", args.rope_theta), fc_norm=config.get("fc_norm", False))
    head = Eagle3Head(shape, draft_ids, embedding, lm_head)
    names = NAMES | {f"fc_norm.{k}.weight": f"fc_norms.{k}" for k in range(len(head.fc_norms))}
    head.load_state_dict({names[k]: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in tensors.items()
                          if k in names}, strict=False)
    return head


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    shards = Shards(args.features)
    embedding, lm_head = target_weights(args.target)
    head = build(args, shards, embedding, lm_head)
    train_ids, held_out = split(shards.lines, args.held_out)
    before = evaluate(head, shards, held_out, args.ttt_steps) if args.init is not None and held_out else None
    report = fit("eagle3", head, shards, train_ids,
                 lambda i, _step: losses(head, *conversation_tensors(shards, i, with_taps=True), args.ttt_steps),
                 args, clip=0.5)
    write_speculators(head, args.out, shards.index["layers"], embedding.shape[0])
    report["train_tokens"] = int(sum(shards.items[i][2] - shards.items[i][1] for i in train_ids))
    if held_out:
        report["held_out"] = evaluate(head, shards, held_out, args.ttt_steps)
    if before is not None:
        report["held_out_before"] = before
    return report


@torch.no_grad()
def evaluate(head: Eagle3Head, shards: Shards, ids: list[int], steps: int) -> dict:
    """On held-out conversations, teacher-forced against the target's greedy tokens: the training
    loss, top-1 agreement per step, and the mean acceptance length (accepted drafts + the target's
    own token, as vLLM counts it) of greedy k = `steps` chain drafting replayed over them
    (loop.simulate_greedy_drafting; exact for the greedy conversations, approximate for sampled
    ones)."""
    correct, counted = np.zeros(steps), np.zeros(steps)
    accepted, anchors, loss_sum, loss_count = 0, 0, 0.0, 0
    for i in ids:
        tokens, mask, taps, final = conversation_tensors(shards, i, with_taps=True)
        loss = losses(head, tokens, mask, taps, final, steps)
        if loss is not None:
            loss_sum, loss_count = loss_sum + float(loss), loss_count + 1
        agree = greedy_agreement(head, tokens, mask, taps, final, steps)
        for j, ok in enumerate(agree):
            correct[j] += int(ok.sum())
            counted[j] += int(mask[1 + j:1 + j + ok.shape[0]].sum())
        # Anchor a drafts the token at a + 2; the first draft follows the prefill, which wrote the
        # first response token (predicted at the first masked position).
        response = np.flatnonzero(mask.numpy())
        if len(response) > 0:
            a, d = simulate_greedy_drafting([ok.numpy() for ok in agree], int(response[0]), int(response[-1]))
            accepted, anchors = accepted + a, anchors + d
    return {"conversations": len(ids), "loss": round(loss_sum / max(loss_count, 1), 4),
            "top1_per_step": (correct / np.maximum(counted, 1)).round(4).tolist(),
            "mean_acceptance_length": round(1 + accepted / max(anchors, 1), 4)}


def arguments() -> argparse.ArgumentParser:
    return command_lines.eagle3()


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(train(arguments().parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
