"""Trains an EAGLE-3 head (Li et al. 2025, arXiv 2503.01840) on cached target features
(features.py) and writes it in speculators' format, which specrs, vLLM and SGLang load
(`{"method": "eagle3", "model": DIR}`). Needs torch (`pip install 'specrs[train]'`).

The head (what crates/specrs-core/src/proposer/heads/eagle.rs runs): `fc` maps the target's
three tapped hidden states `[3H]` to `[H]`; one Llama decoder layer whose attention reads
`[input_layernorm(embed(token)); hidden_norm(fc out)]` `[2H]`, with the fc output as its residual;
`norm`, then an LM head over a draft vocabulary (the `draft_vocab_size` most frequent response
tokens), mapped to target ids by `d2t`. The embedding is the target's, frozen.

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
import struct
import sys
import time

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # the training extra is optional: say how to get it
    raise SystemExit("specrs.train.eagle3 needs torch: pip install 'specrs[train]'") from e


def target_embedding(gguf_path: str) -> np.ndarray:
    """`[vocab, hidden]` float32: the target's token embedding (its tied LM head), dequantized."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path)
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
                int(t.shape[1]), int(t.shape[0]))
    raise SystemExit(f"{gguf_path} has no token_embd.weight")


class Shards:
    """Conversations of the feature cache: (tokens, loss_mask, taps, final) numpy arrays each."""

    def __init__(self, feature_dir: str):
        self.dir = feature_dir
        self.index = json.load(open(os.path.join(feature_dir, "index.json")))
        self.items: list[tuple[str, int, int]] = []
        for name in self.index["shards"]:
            ends = np.load(os.path.join(feature_dir, name))["conversation_ends"]
            starts = np.concatenate([[0], ends[:-1]])
            self.items += [(name, int(s), int(e)) for s, e in zip(starts, ends)]
        self._cache: dict[str, dict] = {}

    def get(self, i: int) -> tuple[np.ndarray, ...]:
        name, s, e = self.items[i]
        if name not in self._cache:
            if len(self._cache) > 4:
                self._cache.pop(next(iter(self._cache)))
            self._cache[name] = dict(np.load(os.path.join(self.dir, name)))
        d = self._cache[name]
        return d["tokens"][s:e], d["loss_mask"][s:e], d["taps"][s:e], d["final"][s:e]

    def token_counts(self, vocab: int) -> np.ndarray:
        counts = np.zeros(vocab, dtype=np.int64)
        for name in self.index["shards"]:
            d = np.load(os.path.join(self.dir, name))
            np.add.at(counts, d["tokens"][np.roll(d["loss_mask"], 1)], 1)
        return counts


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (transformers' Llama) over `x` `[heads, T, head_dim]`."""
    half = x.shape[-1] // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions.float()[:, None] * inv[None, :]
    cos, sin = torch.cos(angles), torch.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Eagle3Head(torch.nn.Module):
    def __init__(self, shape: dict, draft_ids: np.ndarray, embedding: np.ndarray):
        super().__init__()
        h, f = shape["hidden"], shape["ffn"]
        self.shape = shape
        nh, nkv, hd = shape["heads"], shape["kv_heads"], shape["head_dim"]
        lin = lambda o, i: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = lin(h, 3 * h)
        self.hidden_norm = torch.nn.Parameter(torch.ones(h))
        self.input_norm = torch.nn.Parameter(torch.ones(h))
        self.q, self.k, self.v, self.o = lin(nh * hd, 2 * h), lin(nkv * hd, 2 * h), lin(nkv * hd, 2 * h), lin(h, nh * hd)
        self.post_norm = torch.nn.Parameter(torch.ones(h))
        self.gate, self.up, self.down = lin(f, h), lin(f, h), lin(h, f)
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.register_buffer("embedding", torch.from_numpy(embedding), persistent=False)
        self.register_buffer("draft_ids", torch.from_numpy(draft_ids.astype(np.int64)), persistent=False)
        self.lm_head = lin(len(draft_ids), h)
        with torch.no_grad():  # start from the target's own LM head rows
            self.lm_head.weight.copy_(self.embedding[self.draft_ids])

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


def losses(head: Eagle3Head, tokens, mask, taps, final, steps: int, with_stats: bool = False):
    """(weighted loss, [(correct, counted)] per step when `with_stats`: agreement with the target's
    greedy token over its whole vocabulary, which costs a full-vocabulary product) for one
    conversation."""
    outs = head.ttt(tokens, taps, steps)
    target_logits = final @ head.embedding[head.draft_ids].T  # [T, draft_vocab]
    full_argmax = None
    total, stats = 0.0, []
    for j, out in enumerate(outs):
        n = out.shape[0]
        rows = slice(1 + j, 1 + j + n)  # the target's distribution for the drafted token
        valid = mask[rows]
        if not valid.any():
            stats.append((0, 0))
            continue
        p = torch.softmax(target_logits[rows][valid], -1)
        logq = torch.log_softmax(head.logits(out[valid]), -1)
        total = total + (0.8 ** j) * -(p * logq).sum(-1).mean()
        if not with_stats:
            continue
        with torch.no_grad():
            if full_argmax is None:
                full_argmax = (final @ head.embedding.T).argmax(-1)
            drafted = head.draft_ids[logq.argmax(-1)]
            stats.append((int((drafted == full_argmax[rows][valid]).sum()), int(valid.sum())))
    return total, stats


def write_speculators(head: Eagle3Head, out_dir: str, layers: list[int], vocab: int) -> None:
    """speculators' EAGLE-3 directory: config.json + model.safetensors (float32)."""
    os.makedirs(out_dir, exist_ok=True)
    s = head.shape
    w = lambda t: t.detach().cpu().numpy().astype(np.float32)  # noqa: E731
    state = head.state_dict()
    tensors = {name: w(state[attr]) for name, attr in NAMES.items()}
    tensors["d2t"] = (head.draft_ids.numpy() - np.arange(len(head.draft_ids))).astype(np.int64)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    layer = {"model_type": "llama", "hidden_size": s["hidden"], "num_attention_heads": s["heads"],
             "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "intermediate_size": s["ffn"],
             "vocab_size": vocab, "rms_norm_eps": s["eps"], "rope_theta": s["theta"],
             "max_position_embeddings": 8192, "num_hidden_layers": 1}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
                   "transformer_layer_config": layer, "draft_vocab_size": len(head.draft_ids),
                   "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": layers,
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


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """float32 / int64 tensors to a safetensors file, atomically (a temporary file, renamed)."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": "I64" if array.dtype == np.int64 else "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    os.replace(path + ".tmp", path)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """F32/F16/BF16/I64 tensors of a safetensors file."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[start:end]
        if info["dtype"] == "BF16":
            array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(raw, {"F32": np.float32, "F16": np.float16, "I64": np.int64}[info["dtype"]])
        out[name] = array.reshape(info["shape"])
    return out


def read_speculators(head_dir: str) -> tuple[dict, np.ndarray, dict[str, np.ndarray]]:
    """(config, draft_ids, tensors) of an EAGLE-3 head directory in speculators' format."""
    config = json.load(open(os.path.join(head_dir, "config.json")))
    tensors = read_safetensors(os.path.join(head_dir, "model.safetensors"))
    draft_ids = np.arange(len(tensors["d2t"])) + tensors["d2t"]
    return config, draft_ids, tensors


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    shards = Shards(args.features)
    embedding = target_embedding(args.target)
    vocab, hidden = embedding.shape
    shape = dict(hidden=hidden, heads=args.heads, kv_heads=args.kv_heads, head_dim=hidden // args.heads,
                 ffn=args.ffn, eps=1e-5, theta=args.rope_theta)
    if args.init is not None:  # fine-tune a head (e.g. on recorded traffic): its shape and draft vocabulary
        config, draft_ids, tensors = read_speculators(args.init)
        layer = config["transformer_layer_config"]
        shape.update(heads=layer["num_attention_heads"], kv_heads=layer["num_key_value_heads"],
                     head_dim=layer.get("head_dim", hidden // layer["num_attention_heads"]),
                     ffn=layer["intermediate_size"], eps=layer.get("rms_norm_eps", 1e-5),
                     theta=layer.get("rope_theta", args.rope_theta))
        head = Eagle3Head(shape, draft_ids, embedding)
        head.load_state_dict({NAMES[k]: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in tensors.items()
                              if k in NAMES}, strict=False)
    else:
        counts = shards.token_counts(vocab)
        draft_ids = np.sort(np.argsort(-counts, kind="stable")[: args.draft_vocab])
        head = Eagle3Head(shape, draft_ids, embedding)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    n = len(shards.items)
    held_out = list(range(0, n, max(2, round(1 / args.held_out))))  # every k-th conversation
    train_ids = [i for i in range(n) if i not in set(held_out)]
    ckpt = os.path.join(args.out, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["opt"])
        step = state["step"]
    rng = np.random.default_rng(args.seed + step)
    total_steps = int(args.epochs * len(train_ids))
    t0 = time.perf_counter()
    while step < total_steps:
        i = train_ids[rng.integers(len(train_ids))]
        tokens, mask, taps, final = (torch.from_numpy(np.asarray(a)) for a in shards.get(i))
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, _ = losses(head, tokens.long(), mask, taps.float(), final.float(), args.ttt_steps)
        if torch.is_tensor(loss):
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
        step += 1
        if step % args.log_every == 0:
            print(f"eagle3: step {step}/{total_steps} loss {float(loss.detach()):.3f} lr {lr:.2e} "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        if step % args.save_every == 0 or step == total_steps:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    write_speculators(head, args.out, shards.index["layers"], vocab)
    return evaluate(head, shards, held_out, args.ttt_steps)


@torch.no_grad()
def evaluate(head: Eagle3Head, shards: Shards, ids: list[int], steps: int) -> dict:
    """Teacher-forced top-1 agreement with the target's greedy token per step on held-out data."""
    correct, counted = np.zeros(steps), np.zeros(steps)
    for i in ids:
        tokens, mask, taps, final = (torch.from_numpy(np.asarray(a)) for a in shards.get(i))
        _, stats = losses(head, tokens.long(), mask, taps.float(), final.float(), steps, with_stats=True)
        for j, (c, k) in enumerate(stats):
            correct[j] += c
            counted[j] += k
    return {"held_out_conversations": len(ids), "top1_per_step": (correct / np.maximum(counted, 1)).round(4).tolist()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", required=True, help="directory from specrs.train.features")
    parser.add_argument("--target", required=True, help="the target's GGUF (its embedding is read)")
    parser.add_argument("--out", required=True, help="head directory (config.json, model.safetensors, checkpoint)")
    parser.add_argument("--init", default=None, help="an EAGLE-3 head directory to fine-tune (its shape and draft "
                        "vocabulary are kept)")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--rope-theta", type=float, default=100000.0)
    parser.add_argument("--ttt-steps", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--held-out", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(train(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
