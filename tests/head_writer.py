"""Random hidden-state heads in the formats the field publishes, written with numpy (no torch), for
tests on real targets: EAGLE-1 (the EAGLE repository's directory), EAGLE-3 (speculators'), MTP
(llama.cpp's nextn tensors in a GGUF file), the IBM MLP speculator, Medusa (vLLM's format with a
truncated vocabulary), DFlash block drafters (dflash's) and DSpark's (mlx-dspark's). Their acceptance is near zero; they test loading, rollback and losslessness.
Reference logits for these formats come from scripts/make_head_golden.py on tiny targets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf_writer import FLOAT32, STRING, UINT32, GgufModel, Tensor

from specrs.train.safetensors import read_safetensors, write_safetensors

# SmolLM2-135M's shape (the default model).
SMOLLM2 = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152, layers=30, rope_theta=100000.0)


class Random:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def linear(self, rows: int, cols: int) -> np.ndarray:
        return (self.rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(self, n: int) -> np.ndarray:
        return (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)


def llama_layer(r: Random, prefix: str, s: dict, attn_in: int, input_norm: bool = True) -> dict[str, np.ndarray]:
    q, kv, h, f = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["hidden"], s["ffn"]
    t = {
        f"{prefix}.self_attn.q_proj.weight": r.linear(q, attn_in),
        f"{prefix}.self_attn.k_proj.weight": r.linear(kv, attn_in),
        f"{prefix}.self_attn.v_proj.weight": r.linear(kv, attn_in),
        f"{prefix}.self_attn.o_proj.weight": r.linear(h, q),
        f"{prefix}.post_attention_layernorm.weight": r.norm(h),
        f"{prefix}.mlp.gate_proj.weight": r.linear(f, h),
        f"{prefix}.mlp.up_proj.weight": r.linear(f, h),
        f"{prefix}.mlp.down_proj.weight": r.linear(h, f),
    }
    if input_norm:
        t[f"{prefix}.input_layernorm.weight"] = r.norm(h)
    return t


def llama_config(s: dict, **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["hidden"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
        "intermediate_size": s["ffn"], "vocab_size": s["vocab"], "rms_norm_eps": 1e-5,
        "rope_theta": s["rope_theta"], "max_position_embeddings": 8192, "num_hidden_layers": 1, **extra,
    }


def write_eagle(out: Path, s: dict = SMOLLM2, seed: int = 1, **config) -> Path:
    """EAGLE-1 as the EAGLE repository saves it: fc (with bias) and a layer without input norm."""
    out.mkdir(parents=True, exist_ok=True)
    r = Random(seed)
    h = s["hidden"]
    t = {"fc.weight": r.linear(h, 2 * h), "fc.bias": 0.1 * r.norm(h), **llama_layer(r, "layers.0", s, h, False)}
    write_safetensors(out / "model.safetensors", t)
    (out / "config.json").write_text(json.dumps(llama_config(s, bias=True, **config)))
    return out


def write_eagle3(out: Path, s: dict = SMOLLM2, seed: int = 2, draft_vocab: int = 8192,
                 layer_ids: list[int] | None = None, with_d2t: bool = True, **config) -> Path:
    """EAGLE-3 as speculators saves it (transformer_layer_config, layers.0.*, d2t)."""
    out.mkdir(parents=True, exist_ok=True)
    r = Random(seed)
    h, taps = s["hidden"], layer_ids or [2, s["layers"] // 2, s["layers"] - 3]
    t = {
        "fc.weight": r.linear(h, len(taps) * h),
        "layers.0.hidden_norm.weight": r.norm(h),
        **llama_layer(r, "layers.0", s, 2 * h),
        "norm.weight": r.norm(h),
        "lm_head.weight": r.linear(draft_vocab, h),
    }
    if with_d2t:
        draft_ids = np.sort(r.rng.choice(s["vocab"], draft_vocab, replace=False))
        t["d2t"] = (draft_ids - np.arange(draft_vocab)).astype(np.int64)
    write_safetensors(out / "model.safetensors", t)
    layer = llama_config(s)
    layer.pop("architectures")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab, "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": layer_ids,
        "target_hidden_size": None, "speculators_config": {"algorithm": "eagle3"}, **config,
    }))
    return out


def write_mtp_gguf(path: Path, s: dict = SMOLLM2, seed: int = 3) -> Path:
    """One MTP layer as llama.cpp names it (blk.N.nextn.* beside the block's tensors, N = the
    target's layer count), F32, sharing the target's embedding and LM head."""
    r = Random(seed)
    h, q, kv, f, b = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["ffn"], s["layers"]
    tensors = {  # candle shape [rows, cols]; GGUF dims are reversed
        f"blk.{b}.nextn.eh_proj.weight": r.linear(h, 2 * h),
        f"blk.{b}.nextn.enorm.weight": r.norm(h),
        f"blk.{b}.nextn.hnorm.weight": r.norm(h),
        f"blk.{b}.nextn.shared_head_norm.weight": r.norm(h),
        f"blk.{b}.attn_norm.weight": r.norm(h),
        f"blk.{b}.attn_q.weight": r.linear(q, h),
        f"blk.{b}.attn_k.weight": r.linear(kv, h),
        f"blk.{b}.attn_v.weight": r.linear(kv, h),
        f"blk.{b}.attn_output.weight": r.linear(h, q),
        f"blk.{b}.ffn_norm.weight": r.norm(h),
        f"blk.{b}.ffn_gate.weight": r.linear(f, h),
        f"blk.{b}.ffn_up.weight": r.linear(f, h),
        f"blk.{b}.ffn_down.weight": r.linear(h, f),
    }
    model = GgufModel()
    model.metadata = {
        "general.architecture": (STRING, "llama"),
        "llama.block_count": (UINT32, b + 1),
        "llama.nextn_predict_layers": (UINT32, 1),
        "llama.embedding_length": (UINT32, h),
        "llama.feed_forward_length": (UINT32, f),
        "llama.attention.head_count": (UINT32, s["heads"]),
        "llama.attention.head_count_kv": (UINT32, s["kv_heads"]),
        "llama.attention.layer_norm_rms_epsilon": (FLOAT32, 1e-5),
        "llama.rope.freq_base": (FLOAT32, s["rope_theta"]),
    }
    model.tensors = [Tensor(n, list(reversed(a.shape)), 0, a.astype("<f4").tobytes()) for n, a in tensors.items()]
    model.write(path)
    return path


def write_mlp_speculator(out: Path, s: dict = SMOLLM2, seed: int = 4, n_predict: int = 3, inner: int = 64,
                         **config) -> Path:
    """IBM's MLP speculator (speculator.* names) with tied weights, which keeps a 49k-vocabulary
    head small."""
    out.mkdir(parents=True, exist_ok=True)
    r = Random(seed)
    h, v = s["hidden"], s["vocab"]
    emb, head, ln_w, ln_b, proj1 = r.linear(v, inner), r.linear(v, inner), r.norm(inner), 0.1 * r.norm(inner), r.linear(inner, inner)
    t = {"speculator.proj.0.weight": r.linear(inner, h)}
    for i in range(n_predict):
        t |= {f"speculator.emb.{i}.weight": emb, f"speculator.head.{i}.weight": head,
              f"speculator.ln.{i}.weight": ln_w, f"speculator.ln.{i}.bias": ln_b}
        if i >= 1:
            t[f"speculator.proj.{i}.weight"] = proj1
    write_safetensors(out / "model.safetensors", t)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "vocab_size": v,
        "emb_dim": h, "inner_dim": inner, "n_predict": n_predict, "top_k_tokens_per_head": [1] * n_predict,
        "n_candidates": 1, "tie_weights": True, "scale_input": True, **config,
    }))
    return out


def write_medusa(out: Path, s: dict = SMOLLM2, seed: int = 5, num_heads: int = 3, truncated: int = 8192,
                 **config) -> Path:
    """Medusa in vLLM's format, one LM head shared by every head over a truncated vocabulary."""
    out.mkdir(parents=True, exist_ok=True)
    r = Random(seed)
    h = s["hidden"]
    t = {f"blocks.{i}.layers.0.weight": r.linear(h, h) for i in range(num_heads)}
    t |= {f"blocks.{i}.layers.0.bias": 0.1 * r.norm(h) for i in range(num_heads)}
    t["lm_heads.0.weight"] = r.linear(truncated, h)
    t["token_map"] = np.sort(r.rng.choice(s["vocab"], truncated, replace=False)).astype(np.int64)
    write_safetensors(out / "model.safetensors", t)
    (out / "config.json").write_text(json.dumps({
        "num_heads": num_heads, "num_hidden_layers": 1, "hidden_size": h, "vocab_size": s["vocab"],
        "truncated_vocab_size": truncated, "original_lm_head": True, "medusa_fc_bias": True, **config,
    }))
    return out


def write_dflash(out: Path, s: dict = SMOLLM2, seed: int = 6, num_layers: int = 1, block_size: int = 8,
                 layer_ids: list[int] | None = None, mask_token_id: int = 0, **config) -> Path:
    """A DFlash block drafter as PyPI dflash 0.1.0 saves one (DFlashDraftModel: a Qwen3 config with
    num_target_layers and dflash_config; layers.{i}.* with q/k norms, fc over the tapped layers,
    hidden_norm, norm). Without layer_ids, dflash's own default taps for the target's depth."""
    out.mkdir(parents=True, exist_ok=True)
    r = Random(seed)
    h, hd = s["hidden"], s["head_dim"]
    num_taps = len(layer_ids) if layer_ids is not None else num_layers
    t = {"fc.weight": r.linear(h, num_taps * h), "hidden_norm.weight": r.norm(h), "norm.weight": r.norm(h)}
    for i in range(num_layers):
        t |= llama_layer(r, f"layers.{i}", s, h)
        t[f"layers.{i}.self_attn.q_norm.weight"] = r.norm(hd)
        t[f"layers.{i}.self_attn.k_norm.weight"] = r.norm(hd)
    write_safetensors(out / "model.safetensors", t)
    dflash_config = {"block_size": block_size, "mask_token_id": mask_token_id}
    if layer_ids is not None:
        dflash_config["target_layer_ids"] = layer_ids
    (out / "config.json").write_text(json.dumps(llama_config(
        s, architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=num_layers,
        num_target_layers=s["layers"], dflash_config=dflash_config, **config,
    )))
    return out


def write_dspark(out: Path, s: dict = SMOLLM2, seed: int = 7, block_size: int = 6, rank: int = 16,
                 layer_ids: list[int] | None = None, mask_token_id: int = 0, **config) -> Path:
    """A DSpark drafter in mlx-dspark's standalone format: DFlash's layers (one) drafting from the
    anchor's row too (logits_start 0), the target's embedding and LM head, a Markov head of `rank`
    and a confidence head reading [row ; markov_w1[previous]]."""
    layer_ids = layer_ids if layer_ids is not None else [1, s["layers"] // 2, s["layers"] - 3]
    write_dflash(out, s, seed, num_layers=1, block_size=block_size, layer_ids=layer_ids, mask_token_id=mask_token_id)
    r = Random(seed + 100)
    h, v = s["hidden"], s["vocab"]
    tensors = {"markov_head.markov_w1.weight": r.rng.standard_normal((v, rank)).astype(np.float32),
               "markov_head.markov_w2.weight": r.linear(v, rank),
               "confidence_head.proj.weight": r.linear(1, h + rank),
               "confidence_head.proj.bias": np.zeros(1, np.float32)}
    write_safetensors(out / "model.safetensors", {**read_safetensors(str(out / "model.safetensors")), **tensors})
    (out / "config.json").write_text(json.dumps({
        "architectures": ["DSparkDraftModel"], "model_type": "qwen3", "hidden_size": h, "intermediate_size": s["ffn"],
        "num_hidden_layers": 1, "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"], "rms_norm_eps": 1e-5, "rope_theta": s["rope_theta"], "vocab_size": v,
        "block_size": block_size, "mask_token_id": mask_token_id, "target_layer_ids": layer_ids, "logits_start": 0,
        "markov_rank": rank, "enable_confidence_head": True, "confidence_head_with_markov": True, **config,
    }))
    return out
