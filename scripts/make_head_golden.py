"""Write tests/golden/heads/<case>/: tiny random speculative-decoding heads in their published on-disk
formats, and reference draft logits for each, computed by the heads' own libraries where one exists
and by a short independent torch implementation where none does. The test suite reads only these
files; nothing here runs in the Makefile.

Each case directory holds the head (config.json + model.safetensors, in the format the case names; a
single head.gguf for eagle3_llama_gguf) and reference.json:
    {"case", "method", "target", "model", "library", "prompt_ids", "draft_token_ids", "logits"}
`target` and `model` are paths relative to the repository root (`model` is null when the MTP layers
live inside the target's own checkpoint, then copied to <case>/target/). `logits` holds one row of 256
target-vocabulary logits per draft step (null outside an EAGLE-3 head's draft vocabulary).

Targets are the committed tiny models of tests/golden/hf/{llama,qwen2,qwen3} (transformers 5.24), run
in float32 with eager attention (qwen2's bf16 weights are upcast exactly). Conventions (specrs'):
- prompt P: 12 ids in 3..255; the target runs over P[:-1]; target row j pairs with token P[j+1].
- FinalNorm = transformers' hidden_states[-1]; Residual(i) = hidden_states[i] (residual stream entering
  block i).
- Recurrent heads (eagle, eagle3, mtp): step 0 runs all pairs (RoPE positions 0..n-1) and reads the
  last row; step s >= 1 adds one row (fed-back hidden of the previous step, greedy token d_s) at
  position n-1+s. 3 steps. Every recurrent case is run twice, with a KV cache and by full recompute,
  and the two must agree.
- Parallel heads (mlp_speculator, medusa): state = FinalNorm of row n-1; MLP head 0 gets P[-1], head
  i > 0 the greedy token of head i-1; Medusa heads ignore tokens.

Cases, and what computes their reference:
  eagle_llama, eagle_qwen2                  EAGLE-1 dir (fc with bias, layer 0 without input norm):
                                            eagle-llm 1.2.1 (eagle.model.cnets.Model)
  eagle3_llama_speculators                  speculators 0.9.0 Eagle3DraftModel, d2t/t2d (draft vocab 128),
                                            taps [0, 1, 1]; step 0 also checked against its own forward()
  eagle3_qwen2_specforge                    specforge 0.2.0 LlamaForCausalLMEagle3 (midlayer.*, eagle_config);
                                            checked against speculators' layer with the same weights
                                            (specforge feeds the pre-norm output back, like speculators)
  eagle3_llama_speculators_options          speculators 0.9.0 with norm_before_residual, fc_norm and
                                            norm_output true, full draft vocabulary (no d2t)
  mtp_qwen3_speculators                     speculators 0.9.0 MTPDraftModel; step 0 checked against forward()
  mtp_llama_deepseek, mtp_qwen2_mimo        independent torch (vLLM deepseek_mtp / mimo_mtp, written from
                                            their published formulas; the block checked against
                                            transformers' decoder layer). Both zero the embedding of the
                                            row at position 0, as vLLM's deepseek_mtp.py and mimo_mtp.py do
                                            (MIMO_MASK_POSITION0 below); the MTP layers are written into a
                                            float32 copy of the target (<case>/target, config dtype float32)
  mtp_llama_deepseek_2layers                independent torch: two DeepSeek-style MTP layers in the target
                                            (num_nextn_predict_layers 2), draft step s run by layer s % 2
                                            (vLLM's spec_step_idx % n), every layer reading the context
                                            (specrs' choice: each layer's cache holds the context and its
                                            own draft rows, keys at their true positions); 4 steps
  mlp_speculator_llama, _qwen2              independent torch (IBM fms-extras MLPSpeculator / vLLM
                                            mlp_speculator formula; fms-extras is not on PyPI), computed
                                            from the tensors read back from the written file
  medusa_llama                              medusa-llm 0.1 (MedusaModel.medusa_head)
  medusa_qwen2_vllm                         independent torch (vLLM medusa format), checked against
                                            medusa-llm's ResBlock
  dflash_llama, dflash_qwen3_options,       dflash 0.1.0 DFlashDraftModel (from_pretrained of the written files),
  dflash_qwen2_causal                       run with dflash_generate's KV-cache pattern and checked against a full
                                            recompute; block logits at 3 steps of one request (the prompt, then
                                            s + 1 accepted drafts and a random target token appended, s = 0, 1:
                                            `later_steps`). llama: dflash's default taps on a 2-layer target
                                            (layer 1's output = transformers' last, final-normed hidden state),
                                            block 4; qwen3: 2 layers, taps [0, 1], block 5, input_embedding_scale,
                                            output_multiplier, final_logit_softcapping; qwen2: is_causal, taps [0]
  dspark_qwen3                              DSpark in mlx-dspark 0.20.3's standalone format: every row drafting
                                            (logits_start 0), its own LM head over a 128-token draft vocabulary
                                            (d2t), soft-cap 20, Markov head (rank 8) and confidence head; 3 steps
                                            with confidences. Computed twice, and the two must agree: dflash 0.1.0's
                                            DFlashDraftModel for the block (same layer weights) with an independent
                                            torch implementation of the heads, and mlx-dspark's own DSparkDrafter
                                            (load_drafter, f32, on mlx's CPU backend: mlx-cpu 0.32.4, with mlx-lm
                                            0.32.2 and mlx-vlm 0.7.10 installed for its imports)
  eagle3_llama_gguf                         no computation of its own: the committed
                                            eagle3_llama_speculators head re-encoded as llama.cpp's `eagle3`
                                            GGUF (head.gguf) the way its convert_hf_to_gguf.py writes it,
                                            with gguf-py 0.19.0; same reference. Checked: every tensor read
                                            back bit-exact (q/k after undoing the RoPE row permutation), d2t
                                            = absolute ids, metadata, and a torch forward of llama.cpp's
                                            eagle3 graph on the read-back file reproduces the reference.
                                            Runs after (and has no seed apart from) that case

Seeds are fixed; torch.compile is disabled (specforge decorates its RoPE with it) so the run is
deterministic on the CPU. A case whose greedy choice at some step is within GAP of the runner-up is
redrawn with the next seed, so an implementation that agrees to float32 rounding picks the same tokens.

Needs (CPU is enough; the libraries are installed without their serving/training dependencies):
    python -m venv /tmp/ref && /tmp/ref/bin/pip install torch transformers safetensors
    /tmp/ref/bin/pip install --no-deps eagle-llm==1.2.1 medusa-llm==0.1 specforge==0.2.0 speculators==0.9.0
    /tmp/ref/bin/pip install pydantic datasets openai hs-connectors==0.9.0   # what importing speculators needs
    /tmp/ref/bin/pip install gguf==0.19.0                                     # llama.cpp's gguf-py (eagle3_llama_gguf)
    /tmp/ref/bin/pip install --no-deps dflash==0.1.0                          # the dflash_* cases
    /tmp/ref/bin/pip install "mlx[cpu]==0.32.4" pillow requests               # dspark_qwen3: mlx-dspark
    /tmp/ref/bin/pip install --no-deps mlx-dspark==0.20.3 mlx-lm==0.32.2 mlx-vlm==0.7.10
    /tmp/ref/bin/python scripts/make_head_golden.py [case ...]
(written with torch 2.15.0, transformers 5.24.0, safetensors 0.8.0, pydantic 2.14.4, datasets 5.2.0,
openai 3.57.0, hs-connectors 0.9.0, gguf 0.19.0; the dflash_* cases with transformers 5.25.0 and dflash
0.1.0; two runs write byte-identical files)
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # before torch: specforge's @torch.compile RoPE

import json
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
HF = ROOT / "tests" / "golden" / "hf"
OUT = ROOT / "tests" / "golden" / "heads"
H, V, EPS, DV = 64, 256, 1e-6, 128
PROMPT_LEN, STEPS = 12, 3
GAP = 2e-3  # smallest allowed top-1 / top-2 logit gap at a greedy choice
TOL = 1e-4  # KV-cached vs recomputed, and library vs driver
MIMO_MASK_POSITION0 = True  # vLLM's mimo_mtp.py zeroes inputs_embeds[positions == 0], as deepseek_mtp.py does


# ----------------------------------------------------------------------------------------------- helpers
def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


class Rand:
    """Seeded draws: linear weights ~ N(0, 1/fan_in), norms ~ 1 + 0.1 N, biases ~ 0.1 N."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def n(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def linear(self, out_dim, in_dim):
        return self.n(out_dim, in_dim) / math.sqrt(in_dim)

    def norm(self, dim):
        return 1 + 0.1 * self.n(dim)

    def bias(self, dim):
        return 0.1 * self.n(dim)

    def tensor_like(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 2:
            return self.linear(*t.shape)
        return self.norm(t.shape[0]) if "norm" in name or name.startswith("ln") else self.bias(t.shape[0])

    def fill(self, module: torch.nn.Module, skip=("embed_tokens", "verifier_")):
        """Randomize every parameter of a library module in place (names sorted: order-independent)."""
        with torch.no_grad():
            for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
                if not name.startswith(skip):
                    p.copy_(self.tensor_like(name, p))


def prompt_ids(seed: int) -> list[int]:
    return torch.randint(3, V, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def f32_target(family: str) -> Path:
    """The target directory specrs loads: the tiny model itself, or for a bf16 one (Qwen2) a float32
    copy under heads/targets/, so specrs and the reference read the same hidden states (specrs runs
    an HF model in its stored dtype)."""
    if json.loads((HF / family / "config.json").read_text()).get("dtype") == "float32":
        return HF / family
    dst = OUT / "targets" / family
    if not dst.exists():
        copy_target(family, dst, {}, {})
    return dst


class Target:
    def __init__(self, family: str, path: Path | None = None):
        self.path = path or f32_target(family)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.config = self.model.config
        self.embed = self.model.get_input_embeddings().weight.detach().clone()
        self.lm_head = self.model.get_output_embeddings().weight.detach().clone()
        self.theta = self.config.rope_parameters["rope_theta"]

    def hidden(self, prompt: list[int]) -> tuple[torch.Tensor, ...]:
        """transformers' hidden_states over P[:-1]: [L+1] x [n, H]; [-1] is after the final norm."""
        with torch.no_grad():
            out = self.model(torch.tensor([prompt[:-1]]), output_hidden_states=True)
        return tuple(h[0] for h in out.hidden_states)


def rms(x, w, eps=EPS):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """Llama/NeoX RoPE (rotate-half) on x [heads, m, d] at integer positions pos [m]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.tensor(pos, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def additive_causal(q_len: int, kv_len: int) -> torch.Tensor:
    """[1, 1, q, kv] additive mask for q new rows after kv - q cached ones."""
    past = kv_len - q_len
    k = torch.arange(kv_len)[None]
    q = torch.arange(q_len)[:, None] + past
    return torch.where(k > q, float("-inf"), 0.0)[None, None]


def decoder_block(w: dict, p: str, x, pos, cache, cfg, theta):
    """Pre-norm Llama/Qwen2 block (optional q/k/v biases), independent of transformers.
    x [m, H]; cache: None or a dict holding this block's rotated keys and values."""
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    m = x.shape[0]
    h = rms(x, w[p + "input_layernorm.weight"])
    proj = lambda n: F.linear(h, w[f"{p}self_attn.{n}_proj.weight"], w.get(f"{p}self_attn.{n}_proj.bias"))
    q = rope(proj("q").view(m, nh, hd).transpose(0, 1), pos, theta)
    k = rope(proj("k").view(m, nkv, hd).transpose(0, 1), pos, theta)
    v = proj("v").view(m, nkv, hd).transpose(0, 1)
    if cache is not None:
        if "k" in cache:
            k, v = torch.cat([cache["k"], k], 1), torch.cat([cache["v"], v], 1)
        cache["k"], cache["v"] = k, v
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    att = (q @ k.transpose(1, 2)) / math.sqrt(hd) + additive_causal(m, k.shape[1])[0]
    o = (att.softmax(-1) @ v).transpose(0, 1).reshape(m, nh * hd)
    x = x + F.linear(o, w[p + "self_attn.o_proj.weight"])
    h = rms(x, w[p + "post_attention_layernorm.weight"])
    g, u = F.linear(h, w[p + "mlp.gate_proj.weight"]), F.linear(h, w[p + "mlp.up_proj.weight"])
    return x + F.linear(F.silu(g) * u, w[p + "mlp.down_proj.weight"])


def check_block_against_transformers(w: dict, p: str, target: Target):
    """decoder_block == transformers' decoder layer of the target's family, same weights."""
    layer = type(target.model.model.layers[0])(target.config, 0).eval()
    own = {k[len(p) :]: v for k, v in w.items() if k.startswith(p)}
    assert not layer.load_state_dict(own, strict=False).missing_keys
    x, pos = Rand(99).n(1, 7, H), torch.arange(3, 10)[None]
    with torch.no_grad():
        pe = target.model.model.rotary_emb(x, pos)
        ref = layer(x, attention_mask=additive_causal(7, 7), position_ids=pos, position_embeddings=pe)
        ref = ref[0] if isinstance(ref, tuple) else ref
        mine = decoder_block(w, p, x[0], pos[0].tolist(), None, target.config, target.theta)
    diff = (ref[0] - mine).abs().max().item()
    assert diff < TOL, f"independent block differs from transformers by {diff}"
    return diff


def block_weights(r: Rand, p: str, cfg, bias: bool) -> dict:
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    w = {p + "input_layernorm.weight": r.norm(H), p + "post_attention_layernorm.weight": r.norm(H)}
    for n, out in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
        w[f"{p}self_attn.{n}_proj.weight"] = r.linear(out, H)
        if bias:
            w[f"{p}self_attn.{n}_proj.bias"] = r.bias(out)
    w[p + "self_attn.o_proj.weight"] = r.linear(H, nh * hd)
    i = cfg.intermediate_size
    w.update({p + "mlp.gate_proj.weight": r.linear(i, H), p + "mlp.up_proj.weight": r.linear(i, H)})
    w[p + "mlp.down_proj.weight"] = r.linear(H, i)
    return w


def top_gap(logits: torch.Tensor) -> float:
    top = torch.nan_to_num(logits, nan=float("-inf")).topk(2).values
    return (top[0] - top[1]).item()


def greedy(logits: torch.Tensor) -> int:
    return int(torch.nan_to_num(logits, nan=float("-inf")).argmax())


def recurrent(prep, step, new_cache, taps: torch.Tensor, prompt: list[int], modes=(True, False)):
    """Drive a recurrent head over the prompt's pairs then STEPS-1 fed-back rows, once with a KV cache
    and once by full recompute (modes). step(rows [m,H], tokens [m], positions [m], cache) -> (fed-back [m,H],
    target-vocab logits [m,V]) for the new rows. Returns (logits per step, draft ids, max difference)."""
    runs = []
    for cached in modes:
        rows, toks = prep(taps), list(prompt[1:])
        n, cache = len(toks), new_cache() if cached else None
        with torch.no_grad():
            fb, lg = step(rows, toks, list(range(n)), cache)
            logits, drafts = [lg[-1]], [greedy(lg[-1])]
            for s in range(1, STEPS):
                rows, toks = torch.cat([rows, fb[-1:]]), toks + [drafts[-1]]
                if cached:
                    fb, lg = step(rows[-1:], toks[-1:], [n - 1 + s], cache)
                else:
                    fb, lg = step(rows, toks, list(range(n + s)), None)
                logits.append(lg[-1])
                drafts.append(greedy(lg[-1]))
        runs.append((torch.stack(logits), drafts))
    (a, da), (b, db) = runs[0], runs[-1]
    diff = torch.nan_to_num(a - b).abs().max().item()
    assert da == db and diff < TOL and torch.equal(a.isnan(), b.isnan()), f"cached vs recomputed: {diff}"
    return a, da, diff


def scatter_draft(lg_draft: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """[m, DV] draft-vocabulary logits -> [m, V] target-vocabulary, NaN outside the draft vocabulary."""
    if d2t is None:
        return lg_draft
    out = torch.full((lg_draft.shape[0], V), float("nan"))
    out[:, torch.arange(len(d2t)) + d2t] = lg_draft
    return out


def draft_vocab(r: Rand) -> tuple[torch.Tensor, torch.Tensor]:
    """A sorted random draft vocabulary: d2t[j] = target_id - j, t2d = membership mask."""
    sel = torch.sort(torch.randperm(V, generator=r.g)[:DV]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[sel] = True
    return sel - torch.arange(DV), t2d


def json_rows(logits: torch.Tensor) -> list:
    """Logit rows for reference.json: rounded to 6 decimals, null outside a draft vocabulary (NaN)."""
    return [[None if math.isnan(x) else round(x, 6) for x in row.tolist()] for row in logits]


def write_reference(case, method, target_dir, model_dir, library, prompt, drafts, logits):
    rows = json_rows(logits)
    doc = {
        "case": case,
        "method": method,
        "target": rel(target_dir),
        "model": None if model_dir is None else rel(model_dir),
        "library": library,
        "prompt_ids": prompt,
        "draft_token_ids": drafts,
        "logits": rows,
    }
    (OUT / case / "reference.json").write_text(json.dumps(doc) + "\n")


def fresh(case: str) -> Path:
    d = OUT / case
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def copy_target(family: str, dst: Path, extra: dict, cfg_extra: dict) -> Path:
    """A float32 copy of a target directory with extra tensors and config keys."""
    dst.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(HF / family / f, dst / f)
    cfg = json.loads((HF / family / "config.json").read_text())
    cfg.update(cfg_extra, dtype="float32")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    w = {k: v.float() for k, v in load_file(HF / family / "model.safetensors").items()}
    save_file({**w, **{k: v.contiguous() for k, v in extra.items()}}, dst / "model.safetensors")
    return dst


# ----------------------------------------------------------------------------------------------- cases
def eagle1(case, family, seed):
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig

    tgt, r, d = Target(family), Rand(seed), fresh(case)
    c = tgt.config
    conf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True, "hidden_act": "silu",
        "hidden_size": H, "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": 10000.0, "max_position_embeddings": c.max_position_embeddings, "vocab_size": V,
        "pad_token_id": None, "torch_dtype": "float32",
    }
    ecfg = EConfig(**conf)
    ecfg.rope_scaling = None  # transformers >= 5 fills in a dict without "type"; eagle-llm wants None
    head = Model(ecfg, bias=True).float().eval()
    head.gradient_checkpointing = False
    r.fill(head)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(tgt.embed)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(conf, indent=2) + "\n")

    def step(rows, toks, pos, cache):
        kv = cache[0] if cache else None
        out = head(rows[None], input_ids=torch.tensor([toks]), position_ids=torch.tensor([pos]),
                   past_key_values=kv, use_cache=cache is not None)
        if cache is not None:
            out, cache[0] = out
        return out[0], out[0] @ tgt.lm_head.T  # the target's lm_head on the un-normed output

    prompt = prompt_ids(seed)
    logits, drafts, diff = recurrent(lambda h: h, step, lambda: [None], tgt.hidden(prompt)[-1], prompt)
    write_reference(case, "eagle", tgt.path, d, "eagle-llm 1.2.1", prompt, drafts, logits)
    return logits, drafts, f"cached=full {diff:.1e}"


def speculators_eagle3(tgt: Target, r: Rand, d: Path, *, vocab, options: dict):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    c = tgt.config
    tl = transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=c.intermediate_size, num_hidden_layers=1,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=H // c.num_attention_heads, rms_norm_eps=c.rms_norm_eps, rope_theta=tgt.theta,
        max_position_embeddings=c.max_position_embeddings,
    )
    tl._attn_implementation = "eager"  # the default flex attention is not for the CPU
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=vocab, eagle_aux_hidden_state_layer_ids=[0, 1, 1],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=list(c.architectures)),
        ),
        **options,
    )
    m = Eagle3DraftModel(cfg).eval()
    r.fill(m)
    with torch.no_grad():
        m.embed_tokens.weight.copy_(tgt.embed)
        m.verifier_lm_head.weight.zero_()
        m.verifier_norm.weight.fill_(1.0)
        if vocab != V:
            d2t, t2d = draft_vocab(r)
            m.d2t.copy_(d2t)
            m.t2d.copy_(t2d)
    if d is not None:
        m.save_pretrained(d)
        (d / "config.py").unlink(missing_ok=True)  # the library's own config source, written for auto_map
        saved = json.loads((d / "config.json").read_text())
        assert saved["norm_before_residual"] == options.get("norm_before_residual", False)
    return m


def eagle3_step(m):
    """One pass of a speculators Eagle3DraftModel's single layer over new rows (KV cache optional)."""
    layer = m.layers[0]

    def step(rows, toks, pos, cache):
        x = torch.cat([m.embed_tokens(torch.tensor([toks])), rows[None]], -1)
        p = torch.tensor([pos])
        past = cache.get_seq_length() if cache is not None else 0
        o = layer(x, attention_mask=additive_causal(len(toks), past + len(toks)), position_ids=p,
                  past_key_values=cache, use_cache=cache is not None, position_embeddings=m.rotary_emb(x, p))[0]
        fb = m.norm(o) if m.config.norm_output else o
        return fb, scatter_draft(m.lm_head(m.norm(o)), m.d2t)

    return step


def eagle3_prep(m):
    def prep(g):
        if m.input_norm is not None:
            g = m.input_norm(g)
        if m.fc_norm is not None:
            g = torch.cat([n(c) for n, c in zip(m.fc_norm, g.chunk(len(m.fc_norm), -1))], -1)
        return m.fc(g)

    return prep


def eagle3_speculators(case, seed, vocab, options):
    tgt, r, d = Target("llama"), Rand(seed), fresh(case)
    m = speculators_eagle3(tgt, r, d, vocab=vocab, options=options)
    prompt = prompt_ids(seed)
    hs = tgt.hidden(prompt)
    taps = torch.cat([hs[i] for i in (0, 1, 1)], -1)
    logits, drafts, diff = recurrent(eagle3_prep(m), eagle3_step(m), transformers.DynamicCache, taps, prompt)
    # step 0 against the library's own (teacher-forced, TTT) forward, logits captured at lm_head
    seen = []
    hook = m.lm_head.register_forward_hook(lambda mod, i, o: seen.append(o))
    n = taps.shape[0]
    with torch.no_grad():
        m(taps[None], torch.tensor([prompt[1:]]), document_ids=torch.zeros(1, n, dtype=torch.long),
          position_ids=torch.arange(n)[None], ttt_steps=1)
    hook.remove()
    lib = scatter_draft(seen[0][0, -1:], m.d2t)[0]
    lib_diff = torch.nan_to_num(lib - logits[0]).abs().max().item()
    assert lib_diff < TOL, f"library forward step 0 differs by {lib_diff}"
    write_reference(case, "eagle3", tgt.path, d, "speculators 0.9.0", prompt, drafts, logits)
    return logits, drafts, f"cached=full {diff:.1e}, lib fwd {lib_diff:.1e}"


def eagle3_specforge(case, seed):
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    tgt, r, d = Target("qwen2"), Rand(seed), fresh(case)
    c = tgt.config
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=c.intermediate_size, num_hidden_layers=1,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=H // c.num_attention_heads, rms_norm_eps=c.rms_norm_eps, rope_theta=tgt.theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False,
    )
    cfg.draft_vocab_size = DV
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    m = LlamaForCausalLMEagle3(cfg, attention_backend="sdpa").float().eval()
    r.fill(m)
    d2t, t2d = draft_vocab(r)
    with torch.no_grad():
        m.embed_tokens.weight.copy_(tgt.embed)
        m.d2t.copy_(d2t)
        m.t2d.copy_(t2d)
    m.save_pretrained(d)
    apply_legacy_rope_scaling(str(d))  # what specforge's exporters do after saving
    conf = json.loads((d / "config.json").read_text())
    conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
    (d / "config.json").write_text(json.dumps(conf, indent=2) + "\n")

    def step(rows, toks, pos, cache):  # specforge's training path: backbone -> fed back, norm -> lm_head
        assert cache is None
        o = m.backbone(m.embed_tokens(torch.tensor([toks])), rows[None], None,
                       additive_causal(len(toks), len(toks)), torch.tensor([pos]))[0]
        return o, scatter_draft(m.compute_logits(o), m.d2t)

    prompt = prompt_ids(seed)
    hs = tgt.hidden(prompt)
    taps = torch.cat([hs[i] for i in (0, 1, 1)], -1)
    # full recompute only: specforge's cache_hidden is its TTT scheme, not a KV cache
    logits, drafts, _ = recurrent(m.project_hidden_states, step, None, taps, prompt, modes=(False,))
    with torch.no_grad():  # specforge's own forward (positions 0..n-1) for step 0
        own = m.lm_head(m(hidden_states=taps[None], inputs_embeds=m.embed_tokens(torch.tensor([prompt[1:]]))))
    own_diff = torch.nan_to_num(scatter_draft(own[0, -1:], m.d2t)[0] - logits[0]).abs().max().item()
    # the same weights in speculators' layer (midlayer.* -> layers.0.*), KV-cached
    spec = speculators_eagle3(tgt, Rand(0), None, vocab=DV, options={"norm_before_residual": False})
    sd = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(d / "model.safetensors").items()}
    missing = spec.load_state_dict(sd, strict=False).missing_keys
    assert all(k.startswith("verifier_") for k in missing), missing
    other, other_drafts, _ = recurrent(eagle3_prep(spec), eagle3_step(spec), transformers.DynamicCache, taps, prompt)
    x_diff = torch.nan_to_num(other - logits).abs().max().item()
    assert own_diff < TOL and x_diff < TOL and other_drafts == drafts, (own_diff, x_diff)
    write_reference(case, "eagle3", tgt.path, d, "specforge 0.2.0", prompt, drafts, logits)
    return logits, drafts, f"own fwd {own_diff:.1e}, speculators cached {x_diff:.1e}"


def mtp_speculators(case, seed):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.mtp.config import MTPSpeculatorConfig
    from speculators.models.mtp.core import MTPDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tgt, r, d = Target("qwen3"), Rand(seed), fresh(case)
    tl = transformers.AutoConfig.from_pretrained(tgt.path)
    tl._attn_implementation = "eager"
    cfg = MTPSpeculatorConfig(
        transformer_layer_config=tl, num_nextn_predict_layers=1,
        speculators_config=SpeculatorsConfig(
            algorithm="mtp", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=list(tgt.config.architectures)),
        ),
    )
    m = MTPDraftModel(cfg).eval()
    r.fill(m, skip=("embed_tokens", "lm_head", "verifier_"))
    with torch.no_grad():  # the target's embedding and lm_head (not saved: speculators reads the verifier's)
        m.embed_tokens.weight.copy_(tgt.embed)
        m.lm_head.weight.copy_(tgt.lm_head)
    del m.verifier_lm_head  # as MTPDraftModel.load_verifier_weights() does before a checkpoint is saved
    m.save_pretrained(d)
    (d / "config.py").unlink(missing_ok=True)
    layer = m.mtp_layers[0]

    def step(rows, toks, pos, cache):
        p = torch.tensor([pos])
        past = cache.get_seq_length() if cache is not None else 0
        o = layer(hidden_states=rows[None], token_embeddings=m.embed_tokens(torch.tensor([toks])),
                  attention_mask=additive_causal(len(toks), past + len(toks)), position_ids=p,
                  position_embeddings=m.rotary_emb(rows[None], p), past_key_values=cache,
                  use_cache=cache is not None)[0]
        return o, m.lm_head(o)  # final_layernorm is inside the layer; its output is fed back

    prompt = prompt_ids(seed)
    fn = tgt.hidden(prompt)[-1]
    logits, drafts, diff = recurrent(lambda h: h, step, transformers.DynamicCache, fn, prompt)
    # step 0 against the library's forward: rows t < 12 - STEPS - 1 pair hidden[t] with P[t+1]
    with torch.no_grad():
        lib, _, _ = m(input_ids=torch.tensor([prompt]), hidden_states=torch.cat([fn, torch.zeros(1, H)])[None])
        mine = step(fn, prompt[1:], list(range(len(fn))), None)[1]
    k = lib[0].shape[1]
    lib_diff = (lib[0][0] - mine[:k]).abs().max().item()
    assert lib_diff < TOL, f"library forward step 0 differs by {lib_diff}"
    write_reference(case, "mtp", tgt.path, d, "speculators 0.9.0", prompt, drafts, logits)
    return logits, drafts, f"cached=full {diff:.1e}, lib fwd rows<{k} {lib_diff:.1e}"


def mtp_inside(case, family, seed, style):
    """DeepSeek (vLLM deepseek_mtp) or MiMo (vLLM mimo_mtp) MTP layer stored in a copy of the target."""
    base, r, d = Target(family), Rand(seed), fresh(case)
    cfg, L = base.config, base.config.num_hidden_layers
    if style == "deepseek":
        p = f"model.layers.{L}."
        w = {p + "enorm.weight": r.norm(H), p + "hnorm.weight": r.norm(H), p + "eh_proj.weight": r.linear(H, 2 * H)}
        w.update(block_weights(r, p, cfg, bias=False))
        w.update({p + "shared_head.norm.weight": r.norm(H), p + "shared_head.head.weight": r.linear(V, H)})
    else:
        p = "model.mtp_layers.0."
        w = {p + "token_layernorm.weight": r.norm(H), p + "hidden_layernorm.weight": r.norm(H),
             p + "input_proj.weight": r.linear(H, 2 * H), p + "final_layernorm.weight": r.norm(H)}
        w.update(block_weights(r, p, cfg, bias=True))
    tdir = copy_target(family, d / "target", w, {"num_nextn_predict_layers": 1})
    tgt = Target(family, tdir)  # the copy must still be the same target
    prompt = prompt_ids(seed)
    fn = tgt.hidden(prompt)[-1]
    assert torch.allclose(fn, base.hidden(prompt)[-1], atol=1e-6)
    block_diff = check_block_against_transformers(w, p, tgt)

    def step(rows, toks, pos, cache):
        emb = tgt.embed[torch.tensor(toks)].clone()
        if style == "deepseek" or MIMO_MASK_POSITION0:
            emb[torch.tensor(pos) == 0] = 0  # vLLM: inputs_embeds[positions == 0] = 0
        if style == "deepseek":
            x = F.linear(torch.cat([rms(emb, w[p + "enorm.weight"]), rms(rows, w[p + "hnorm.weight"])], -1),
                         w[p + "eh_proj.weight"])
            y = decoder_block(w, p, x, pos, cache, cfg, tgt.theta)  # fed back before the shared head's norm
            return y, F.linear(rms(y, w[p + "shared_head.norm.weight"]), w[p + "shared_head.head.weight"])
        x = torch.cat([rms(rows, w[p + "hidden_layernorm.weight"]), rms(emb, w[p + "token_layernorm.weight"])], -1)
        x = F.linear(x, w[p + "input_proj.weight"])  # MiMo: the hidden state first
        y = rms(decoder_block(w, p, x, pos, cache, cfg, tgt.theta), w[p + "final_layernorm.weight"])
        return y, y @ tgt.lm_head.T

    logits, drafts, diff = recurrent(lambda h: h, step, dict, fn, prompt)
    lib = f"independent torch (vLLM {style}_mtp formula)"
    write_reference(case, "mtp", tdir, None, lib, prompt, drafts, logits)
    return logits, drafts, f"cached=full {diff:.1e}, block vs transformers {block_diff:.1e}"


def mtp_two_layers(case, seed):
    """Two DeepSeek-style MTP layers cycled over draft steps (see the docstring), KV-cached."""
    base, r, d = Target("llama"), Rand(seed), fresh(case)
    cfg, L = base.config, base.config.num_hidden_layers
    ps = [f"model.layers.{L + k}." for k in range(2)]
    w = {}
    for p in ps:
        w.update({p + "enorm.weight": r.norm(H), p + "hnorm.weight": r.norm(H), p + "eh_proj.weight": r.linear(H, 2 * H)})
        w.update(block_weights(r, p, cfg, bias=False))
        w.update({p + "shared_head.norm.weight": r.norm(H), p + "shared_head.head.weight": r.linear(V, H)})
    tdir = copy_target("llama", d / "target", w, {"num_nextn_predict_layers": 2})
    tgt = Target("llama", tdir)
    prompt = prompt_ids(seed)
    fn = tgt.hidden(prompt)[-1]

    def layer(k, rows, toks, pos, cache):
        p = ps[k]
        emb = tgt.embed[torch.tensor(toks)].clone()
        emb[torch.tensor(pos) == 0] = 0  # vLLM: inputs_embeds[positions == 0] = 0
        x = F.linear(torch.cat([rms(emb, w[p + "enorm.weight"]), rms(rows, w[p + "hnorm.weight"])], -1),
                     w[p + "eh_proj.weight"])
        y = decoder_block(w, p, x, pos, cache, cfg, tgt.theta)
        return y, F.linear(rms(y, w[p + "shared_head.norm.weight"]), w[p + "shared_head.head.weight"])

    toks = prompt[1:]
    n, caches = len(toks), [dict(), dict()]
    with torch.no_grad():
        outs = [layer(k, fn, toks, list(range(n)), caches[k]) for k in range(2)]
        y, lg = outs[0]
        logits, drafts = [lg[-1]], [greedy(lg[-1])]
        for step in range(1, STEPS + 1):
            y, lg = layer(step % 2, y[-1:], [drafts[-1]], [n - 1 + step], caches[step % 2])
            logits.append(lg[-1])
            drafts.append(greedy(lg[-1]))
    write_reference(case, "mtp", tdir, None, "independent torch (two vLLM deepseek_mtp layers, cycled)",
                    prompt, drafts, logits)
    return torch.stack(logits), drafts, "layers cycled 0, 1, 0, 1"


def mlp_speculator(case, family, seed, n_predict, prefix, tie, scale_input):
    tgt, r, d = Target(family), Rand(seed), fresh(case)
    inner = 32
    w = {}
    for i in range(n_predict):
        src = 0 if tie else i  # tie_weights: emb/ln/head shared with head 0, proj.i (i >= 2) with proj.1
        psrc = min(i, 1) if tie else i
        w[f"emb.{i}.weight"] = w[f"emb.{src}.weight"].clone() if src != i else r.linear(V, inner)
        proj_in = H if i == 0 else inner
        w[f"proj.{i}.weight"] = w[f"proj.{psrc}.weight"].clone() if psrc != i else r.linear(inner, proj_in)
        w[f"ln.{i}.weight"] = w[f"ln.{src}.weight"].clone() if src != i else r.norm(inner)
        w[f"ln.{i}.bias"] = w[f"ln.{src}.bias"].clone() if src != i else r.bias(inner)
        w[f"head.{i}.weight"] = w[f"head.{src}.weight"].clone() if src != i else r.linear(V, inner)
    save_file({prefix + k: v.contiguous() for k, v in w.items()}, d / "model.safetensors")
    w = {k[len(prefix) :]: v for k, v in load_file(d / "model.safetensors").items()}  # compute from the file
    if tie:
        for i in range(1, n_predict):
            for k in ("emb.{}.weight", "head.{}.weight", "ln.{}.weight", "ln.{}.bias"):
                assert torch.equal(w[k.format(i)], w[k.format(0)])
            assert torch.equal(w[f"proj.{i}.weight"], w[f"proj.{min(i, 1)}.weight"])
    conf = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "emb_dim": H,
            "inner_dim": inner, "vocab_size": V, "n_predict": n_predict, "tie_weights": tie,
            "scale_input": scale_input, "top_k_tokens_per_head": [1] * n_predict, "n_candidates": 1}
    (d / "config.json").write_text(json.dumps(conf, indent=2) + "\n")

    state_weight = 0.5 ** (0.5 / n_predict)
    emb_weight = math.sqrt((1 - state_weight**2) * (inner / 2))
    prompt = prompt_ids(seed)
    s = tgt.hidden(prompt)[-1][-1]
    if scale_input:
        s = s * torch.rsqrt(s.pow(2).mean() + EPS) / math.sqrt(2)  # ln0: no parameters
    tok, logits, drafts = prompt[-1], [], []
    for i in range(n_predict):
        z = F.linear(s, w[f"proj.{i}.weight"]) + emb_weight / state_weight * w[f"emb.{i}.weight"][tok]
        s = F.gelu(rms(z, w[f"ln.{i}.weight"]) + w[f"ln.{i}.bias"])  # exact (erf) GELU
        logits.append(F.linear(s, w[f"head.{i}.weight"]))
        tok = greedy(logits[-1])
        drafts.append(tok)
    logits = torch.stack(logits)
    write_reference(case, "mlp_speculator", tgt.path, d, "independent torch (fms-extras MLPSpeculator formula)",
                    prompt, drafts, logits)
    return logits, drafts, "read back from the file" + (", ties hold" if tie else "")


def medusa(case, family, seed, num_heads, vllm_format):
    from medusa.model import medusa_model as MM

    tgt, r, d = Target(family), Rand(seed), fresh(case)
    w = {}
    for i in range(num_heads):
        w[f"{i}.0.linear.weight"], w[f"{i}.0.linear.bias"] = r.linear(H, H), r.bias(H)
        w[f"{i}.1.weight"] = r.linear(V, H)
    prompt = prompt_ids(seed)
    s = tgt.hidden(prompt)[-1][-1]
    mine = torch.stack([F.linear(s + F.silu(F.linear(s, w[f"{i}.0.linear.weight"], w[f"{i}.0.linear.bias"])),
                                 w[f"{i}.1.weight"]) for i in range(num_heads)])
    if vllm_format:  # vLLM's Medusa: blocks.{i}.layers.0 (with medusa_fc_bias), lm_heads.{i}
        vw = {}
        for i in range(num_heads):
            vw[f"blocks.{i}.layers.0.weight"] = w[f"{i}.0.linear.weight"]
            vw[f"blocks.{i}.layers.0.bias"] = w[f"{i}.0.linear.bias"]
            vw[f"lm_heads.{i}.weight"] = w[f"{i}.1.weight"]
        save_file({k: v.contiguous() for k, v in vw.items()}, d / "model.safetensors")
        conf = {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": num_heads,
                "num_hidden_layers": 1, "hidden_size": H, "vocab_size": V, "medusa_fc_bias": True}
        heads = torch.nn.ModuleList(torch.nn.Sequential(MM.ResBlock(H), torch.nn.Linear(H, V, bias=False))
                                    for _ in range(num_heads))  # medusa-llm's layout, only as a check
        library = "independent torch (vLLM medusa format)"
    else:
        MM.AutoTokenizer.from_pretrained = staticmethod(lambda *a, **k: None)  # MedusaModel loads a tokenizer
        heads = MM.MedusaModel(tgt.model, medusa_num_heads=num_heads, medusa_num_layers=1,
                               base_model_name_or_path="..").medusa_head
        save_file({k: v.contiguous() for k, v in w.items()}, d / "model.safetensors")
        conf = {"medusa_num_heads": num_heads, "medusa_num_layers": 1, "base_model_name_or_path": "..",
                "hidden_size": H, "vocab_size": V}
        library = "medusa-llm 0.1"
    heads.load_state_dict(w)
    with torch.no_grad():
        lib = torch.stack([heads[i](s) for i in range(num_heads)])
    diff = (lib - mine).abs().max().item()
    assert diff < TOL, f"medusa heads differ from the formula by {diff}"
    (d / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    logits = lib if not vllm_format else mine
    drafts = [greedy(row) for row in logits]
    write_reference(case, "medusa", tgt.path, d, library, prompt, drafts, logits)
    return logits, drafts, f"library vs formula {diff:.1e}"


# ------------------------------------------------------------------ llama.cpp eagle3 GGUF (from a committed case)
GGUF_SRC = "eagle3_llama_speculators"  # the speculators head this case re-encodes, tensor for tensor
GGUF_TOKEN_EMBD = True  # see eagle3_llama_gguf: llama.cpp's converter maps embed_tokens.weight when present


def llama_permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute (conversion/llama.py; convert_hf_to_gguf.py before the split),
    verbatim: HF rotate-half q/k rows -> interleaved pairs for ggml's NORM RoPE. Within each head of
    d rows, GGUF row 2*i + h holds HF row h*d/2 + i (i < d/2, h in {0, 1})."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama_permute (n_head = the heads the rows hold: n_head for q, n_head_kv for k)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_interleaved(x, pos, theta):
    """ggml's LLAMA_ROPE_TYPE_NORM (mode 0): rotates adjacent pairs (x[2i], x[2i+1]) by
    pos * theta^(-2i/d). x [m, heads, d], pos [m]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.tensor(pos, dtype=torch.float32)[:, None, None] * inv
    cos, sin = ang.cos(), ang.sin()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).reshape(x.shape)


def eagle3_llama_gguf(case, seed):
    """The eagle3_llama_speculators head, re-encoded as llama.cpp's `eagle3` GGUF exactly as its converter
    (convert_hf_to_gguf.py --outtype f32 --target-model-dir tests/golden/hf/llama; ggml-org/llama.cpp
    conversion/llama.py LlamaModel + conversion/base.py TextModel) writes it. The speculators checkpoint
    is read back from its committed directory, so the two cases hold the same head and share one
    reference (the draft logits are copied, not recomputed); the file is then checked by a torch forward
    written from llama.cpp's src/models/eagle3.cpp graph on the tensors read back with GGUFReader.

    Where this differs from what the converter would do, and why:
    - eagle3.extract_layers: the converter writes [2, L//2, L-3] from the TARGET's layer count
      (num_hidden_layers), ignoring the head's eagle_aux_hidden_state_layer_ids. For this 2-layer tiny
      target that is [2, 1, -1], which is invalid, so the tiny case stores the head's own ids [0, 1, 1]
      (same convention: index i = the residual stream entering target block i).
    - tokenizer: the converter copies the target's tokenizer (set_vocab -> _set_vocab_gpt2 for a
      tokenizer.json target). The tiny target's WordLevel tokenizer is not one it recognizes
      (get_vocab_base_pre raises on the unknown pre-tokenizer hash), so this writes what _set_vocab_gpt2
      writes with tokenizer.ggml.pre = "default": model "gpt2", the 256 tokens, their types, and
      gguf.SpecialVocab's bos/eos/pad ids and add_bos_token. It has no merges (the WordLevel tokenizer
      has none, and gguf-py cannot write an empty array), which llama.cpp's BPE vocab loader would want.
    Everything else follows the converter: t2d dropped; d2t written last as GGML I64 ABSOLUTE target ids
    (draft id + offset, range- and uniqueness-checked); q/k rows permuted (llama_permute); hidden_norm ->
    blk.0.attn_norm_2; embed_tokens.weight -> token_embd.weight (the converter maps every checkpoint
    tensor, and a speculators Eagle3DraftModel checkpoint always holds embed_tokens - here a copy of the
    target's, so the values are the target embedding llama.cpp would otherwise share via ctx_other);
    all tensors float32 (--outtype f32)."""
    from importlib.metadata import version

    import gguf
    import numpy as np

    src, d = OUT / GGUF_SRC, fresh(case)
    conf = json.loads((src / "config.json").read_text())
    ref = json.loads((src / "reference.json").read_text())
    tgt_conf = json.loads((ROOT / ref["target"] / "config.json").read_text())
    hp = {**conf, **conf["transformer_layer_config"]}  # what LlamaModel.index_tensors merges
    assert "draft_vocab_size" in hp and hp["num_hidden_layers"] == 1  # the converter's eagle3 detection
    nh, nkv, hd = hp["num_attention_heads"], hp["num_key_value_heads"], hp["head_dim"]
    w = load_file(src / "model.safetensors")
    arch = "eagle3"
    path = d / "head.gguf"

    # __init__: architecture, then the three eagle3 keys, in the converter's order
    gw = gguf.GGUFWriter(None, arch)
    extract_layers = list(conf["eagle_aux_hidden_state_layer_ids"])  # converter: [2, L//2, L-3], see above
    gw.add_array(f"{arch}.extract_layers", extract_layers)  # python ints -> [INT32]
    target_hidden = conf.get("target_hidden_size") or tgt_conf["hidden_size"]
    gw.add_uint32(f"{arch}.target_hidden_size", target_hidden)
    gw.add_bool(f"{arch}.norm_before_residual", bool(conf.get("norm_before_residual", False)))

    # prepare_tensors: checkpoint order, renamed as LlamaModel.modify_tensors + the eagle3 tensor map do
    names = {
        "embed_tokens.weight": "token_embd.weight",
        "fc.weight": "fc.weight",
        "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
        "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
        "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
        "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
        "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
        "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
        "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
        "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
        "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
        "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
        "lm_head.weight": "output.weight",
        "norm.weight": "output_norm.weight",
    }
    if not GGUF_TOKEN_EMBD:
        del names["embed_tokens.weight"]
    assert set(w) - set(names) <= {"d2t", "t2d", "embed_tokens.weight"}, sorted(w)
    written = {}
    for hf in sorted(w):
        if hf not in names:
            continue  # d2t comes last; t2d is dropped ("not used at runtime")
        t = w[hf].float()
        if hf.endswith("q_proj.weight"):
            t = llama_permute(t, nh, nh)
        elif hf.endswith("k_proj.weight"):
            t = llama_permute(t, nh, nkv)
        written[names[hf]] = t
        gw.add_tensor(names[hf], t.numpy().astype(np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
    d2t = w["d2t"].float().to(torch.int64).numpy().reshape(-1)  # the converter goes through float32 first
    d2t = d2t + np.arange(d2t.size, dtype=np.int64)  # offsets -> absolute target ids
    assert np.all((d2t >= 0) & (d2t < tgt_conf["vocab_size"])) and np.unique(d2t).size == d2t.size
    gw.add_tensor("d2t", d2t, raw_dtype=gguf.GGMLQuantizationType.I64)

    # prepare_metadata: type, model-card metadata, set_gguf_parameters, quantization version
    total, shared, expert, n_expert = gw.get_total_parameter_count()
    meta = gguf.Metadata.load(None, src, None, total)
    if meta.name is None:
        meta.name = src.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    gw.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(gw)
    gw.add_block_count(hp["num_hidden_layers"])
    gw.add_context_length(hp["max_position_embeddings"])
    gw.add_embedding_length(hp["hidden_size"])
    gw.add_feed_forward_length(hp["intermediate_size"])
    gw.add_head_count(nh)
    gw.add_head_count_kv(nkv)
    rope = hp["rope_parameters"]
    assert rope["rope_type"] == "default"  # no rope.scaling.* keys, no rope_freqs tensor
    gw.add_rope_freq_base(rope["rope_theta"])
    gw.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    gw.add_key_length(hd)
    gw.add_value_length(hd)
    gw.add_file_type(gguf.LlamaFileType.ALL_F32)
    gw.add_vocab_size(hp["vocab_size"])  # LlamaModel.set_gguf_parameters
    gw.add_rope_dimension_count(hd)
    gw.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # set_vocab: the target's tokenizer (see above)
    tdir = ROOT / ref["target"]
    vocab = json.loads((tdir / "tokenizer.json").read_text())["model"]["vocab"]
    rev = {i: s for s, i in vocab.items()}
    n_vocab = hp["vocab_size"]
    tokens = [rev.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    gw.add_tokenizer_model("gpt2")
    gw.add_tokenizer_pre("default")
    gw.add_token_list(tokens)
    gw.add_token_types([gguf.TokenType.NORMAL if i in rev else gguf.TokenType.UNUSED for i in range(n_vocab)])
    gguf.SpecialVocab(tdir, load_merges=True).add_to_gguf(gw, quiet=True)

    gw.write_header_to_file(path=path)
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()

    # ---- read it back
    rd = gguf.GGUFReader(path)
    V_ = gguf.GGUFValueType
    kv = {f.name: f for f in rd.fields.values()}

    def val(key, vtype, sub=None):
        f = kv[key]
        assert f.types[0] == vtype and (sub is None or f.types[1] == sub), (key, f.types)
        return f.contents()

    assert val("general.architecture", V_.STRING) == arch
    assert val("general.type", V_.STRING) == "model"
    assert val(f"{arch}.extract_layers", V_.ARRAY, V_.INT32) == extract_layers
    assert val(f"{arch}.target_hidden_size", V_.UINT32) == target_hidden == H
    assert not val(f"{arch}.norm_before_residual", V_.BOOL)
    u32 = {"block_count": 1, "context_length": 128, "embedding_length": H, "feed_forward_length": 128,
           "attention.head_count": nh, "attention.head_count_kv": nkv, "attention.key_length": hd,
           "attention.value_length": hd, "vocab_size": V, "rope.dimension_count": hd}
    for k, v in u32.items():
        assert val(f"{arch}.{k}", V_.UINT32) == v, k
    assert val(f"{arch}.rope.freq_base", V_.FLOAT32) == 10000.0
    assert np.float32(val(f"{arch}.attention.layer_norm_rms_epsilon", V_.FLOAT32)) == np.float32(EPS)
    assert val("general.file_type", V_.UINT32) == 0 and val("general.quantization_version", V_.UINT32) == 2
    assert val("tokenizer.ggml.tokens", V_.ARRAY, V_.STRING) == tokens
    assert (val("tokenizer.ggml.bos_token_id", V_.UINT32), val("tokenizer.ggml.eos_token_id", V_.UINT32)) == (1, 2)

    got = {t.name: t for t in rd.tensors}
    assert set(got) == set(written) | {"d2t"}, sorted(got)
    back = {}
    for name, t in got.items():
        want = gguf.GGMLQuantizationType.I64 if name == "d2t" else gguf.GGMLQuantizationType.F32
        assert t.tensor_type == want, (name, t.tensor_type)
        a = torch.from_numpy(np.array(t.data))
        # GGUF dims are ggml ne (fastest first): the reverse of the torch shape
        assert list(t.shape) == list(reversed(a.shape)), (name, t.shape, a.shape)
        back[name] = a
    assert list(got["fc.weight"].shape) == [3 * target_hidden, H]
    assert list(got["blk.0.attn_q.weight"].shape) == [2 * H, nh * hd]
    assert list(got["blk.0.attn_k.weight"].shape) == [2 * H, nkv * hd]
    assert list(got["output.weight"].shape) == [H, hp["draft_vocab_size"]]
    assert list(got["d2t"].shape) == [hp["draft_vocab_size"]]
    inv = {v: k for k, v in names.items()}
    for name, a in back.items():
        if name == "d2t":
            continue
        if name == "blk.0.attn_q.weight":
            a = llama_unpermute(a, nh)
        elif name == "blk.0.attn_k.weight":
            a = llama_unpermute(a, nkv)
        assert torch.equal(a, w[inv[name]]), name  # un-permuted q/k and every other tensor: bit-exact
    d2t_abs = back["d2t"]
    assert torch.equal(d2t_abs, w["d2t"] + torch.arange(len(w["d2t"])))
    assert torch.equal(torch.zeros(V, dtype=torch.bool).index_fill_(0, d2t_abs, True), w["t2d"])
    in_vocab = [j for j, x in enumerate(ref["logits"][0]) if x is not None]
    assert in_vocab == sorted(d2t_abs.tolist())  # the reference's non-null columns are the d2t targets

    # ---- llama.cpp's eagle3 graph (src/models/eagle3.cpp) on the read-back tensors: encoder fc, then
    # the decoder with interleaved (NORM) RoPE on the permuted q/k, residual = raw g (norm_before_residual
    # false), fed-back g = the pre-norm output, logits scattered through the absolute d2t
    g = {k: v for k, v in back.items()}
    theta = val(f"{arch}.rope.freq_base", V_.FLOAT32)
    eps = float(val(f"{arch}.attention.layer_norm_rms_epsilon", V_.FLOAT32))

    def step(rows, toks, pos, cache):
        assert cache is None
        m = len(toks)
        e = rms(g["token_embd.weight"][torch.tensor(toks)], g["blk.0.attn_norm.weight"], eps)
        gn = rms(rows, g["blk.0.attn_norm_2.weight"], eps)
        cur = torch.cat([e, gn], -1)
        q = rope_interleaved((cur @ g["blk.0.attn_q.weight"].T).view(m, nh, hd), pos, theta).transpose(0, 1)
        k = rope_interleaved((cur @ g["blk.0.attn_k.weight"].T).view(m, nkv, hd), pos, theta).transpose(0, 1)
        v = (cur @ g["blk.0.attn_v.weight"].T).view(m, nkv, hd).transpose(0, 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        att = (q @ k.transpose(1, 2)) / math.sqrt(hd) + additive_causal(m, m)[0]
        o = (att.softmax(-1) @ v).transpose(0, 1).reshape(m, nh * hd) @ g["blk.0.attn_output.weight"].T
        ffn_inp = o + rows
        h = rms(ffn_inp, g["blk.0.ffn_norm.weight"], eps)
        out = ffn_inp + (F.silu(h @ g["blk.0.ffn_gate.weight"].T) * (h @ g["blk.0.ffn_up.weight"].T)) @ g[
            "blk.0.ffn_down.weight"].T
        lg = rms(out, g["output_norm.weight"], eps) @ g["output.weight"].T
        full = torch.full((m, V), float("nan"))
        full[:, d2t_abs] = lg
        return out, full

    prompt = ref["prompt_ids"]
    hs = Target("llama", ROOT / ref["target"]).hidden(prompt)
    taps = torch.cat([hs[i] for i in extract_layers], -1)
    logits, drafts, _ = recurrent(lambda x: x @ g["fc.weight"].T, step, None, taps, prompt, modes=(False,))
    want = torch.tensor([[math.nan if x is None else x for x in row] for row in ref["logits"]])
    diff = torch.nan_to_num(logits - want).abs().max().item()
    assert drafts == ref["draft_token_ids"] and torch.equal(logits.isnan(), want.isnan()) and diff < TOL, diff

    doc = dict(ref, case=case, model=rel(path),
               library=f"llama.cpp eagle3 GGUF layout written with gguf-py {version('gguf')} from the speculators head")
    (d / "reference.json").write_text(json.dumps(doc) + "\n")
    return want, ref["draft_token_ids"], f"tensors bit-exact, eagle3.cpp graph vs ref {diff:.1e}"


def block_request(case, method, library, tgt, d, r, model, prompt, run, draft):
    """Three steps of one request with a block drafter (dflash, dspark): at each context, the
    drafter's output `run(context, target rows, cache, first row's position)` with dflash_generate's
    KV-cache pattern (context rows appended, the block cropped away) and by full recompute, which
    must agree, and its greedy draft `draft(context, output) -> (drafts, logits, extra keys)`; then
    the target accepts s + 1 drafts and writes a random token after them. Writes reference.json
    with `later_steps`; returns (every step's logits, the first step's drafts, the largest
    cached-vs-recomputed difference)."""
    from dflash.model import _make_cache, extract_context_feature

    def features(context):  # [1, len - 1, taps * H]: the target over all but the newest token
        out = tgt.model(torch.tensor([context[:-1]]), output_hidden_states=True)
        return extract_context_feature(out.hidden_states, model.target_layer_ids)

    contexts, cache, fed, steps = [prompt], _make_cache(model.config), 0, []
    with torch.no_grad():
        for s in range(3):
            context = contexts[-1]
            th = features(context)
            cached = run(context, th[:, fed:], cache, fed)
            fed = th.shape[1]
            diff = (cached - run(context, th, None, 0)).abs().max().item()
            assert diff < TOL, f"{case}: cached vs recomputed {diff}"
            drafts, logits, extra = draft(context, cached)
            steps.append((context, drafts, logits, extra, diff))
            contexts.append(context + drafts[: s + 1] + [int(torch.randint(3, V, (1,), generator=r.g))])
    write_reference(case, method, tgt.path, d, library, prompt, steps[0][1], steps[0][2])
    ref = json.loads((d / "reference.json").read_text())
    ref.update(steps[0][3])
    ref["later_steps"] = [{"context_ids": c, "draft_token_ids": t, **extra, "logits": json_rows(lg)}
                          for c, t, lg, extra, _ in steps[1:]]
    (d / "reference.json").write_text(json.dumps(ref) + "\n")
    return torch.cat([lg for _, _, lg, _, _ in steps]), steps[0][1], max(diff for *_, diff in steps)


def dflash(case, family, seed, num_layers, layer_ids, block, options):
    """A DFlash block drafter (PyPI dflash 0.1.0, DFlashDraftModel) over `family`, and its block logits at
    three contexts of one request: the prompt, then the prompt plus accepted drafts and a target token
    twice. The drafter runs with dflash's own KV-cache pattern (dflash_generate: context rows appended,
    the block cropped away after each draft) and by full recompute; the two must agree."""
    from dflash.model import DFlashDraftModel, _crop_to, _output_head, _raw_input_embeddings
    from transformers import Qwen3Config

    tgt, r, d = Target(family), Rand(seed), fresh(case)
    options = dict(options)
    causal = options.pop("is_causal", False)
    dflash_config = {"block_size": block, "mask_token_id": 5, **options}
    if layer_ids is not None:
        dflash_config["target_layer_ids"] = layer_ids
    cfg = Qwen3Config(
        hidden_size=H, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=EPS, vocab_size=V, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        num_target_layers=tgt.config.num_hidden_layers, dflash_config=dflash_config,
        **({"is_causal": True} if causal else {}),
    )
    cfg.dflash_config = dflash_config
    model = DFlashDraftModel(cfg).float().eval()
    r.fill(model)
    model.save_pretrained(d)
    model = DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()  # compute from the files
    head = _output_head(tgt.model)
    scale = float(dflash_config.get("input_embedding_scale", 1.0))

    def block_logits(context, th, cache, first):  # rows of th are positions first..len(context) - 2
        start = len(context) - 1
        ids = torch.tensor([[context[-1]] + [model.mask_token_id] * (block - 1)])
        hidden = model(target_hidden=th, noise_embedding=_raw_input_embeddings(tgt.model, ids, scale),
                       position_ids=torch.arange(first, start + block)[None], past_key_values=cache,
                       use_cache=cache is not None)[:, 1 - block:, :]
        if cache is not None:
            _crop_to(cache, start)
        return model.compute_logits(hidden, head)[0]  # [block - 1, V]

    logits, drafts, worst = block_request(
        case, "dflash", "dflash 0.1.0 (DFlashDraftModel, dflash_generate's cache)", tgt, d, r, model, prompt_ids(seed),
        block_logits, lambda context, lg: ([greedy(row) for row in lg], lg, {}))
    return logits, drafts, f"3 steps, cached vs recomputed {worst:.1e}, taps {model.target_layer_ids}"


def dspark(case, family, seed):
    """A DSpark drafter in mlx-dspark's standalone format (Qwen3 family): DFlash layers drafting from
    the anchor's row too (logits_start 0), its own LM head over a draft vocabulary (d2t), a soft-cap,
    a Markov head (rank 8) and a confidence head reading [row ; markov_w1[previous]]. mlx does not
    install here: the block is dflash 0.1.0's DFlashDraftModel with the same weights (the layers and
    the context are DFlash's, as mlx-dspark's model.py runs them), the heads an independent torch
    implementation of mlx-dspark 0.20.3's formulas (model.py's VanillaMarkov and ConfidenceHead,
    generate.py's cumulative confidence rule). Three steps of one request, as the dflash cases;
    the reference also holds each drafted row's confidence."""
    from dflash.model import DFlashDraftModel, _crop_to, _raw_input_embeddings
    from transformers import Qwen3Config

    tgt, r, d = Target(family), Rand(seed), fresh(case)
    block, rank, cap, layer_ids = 4, 8, 20.0, [0, 1]
    cfg = Qwen3Config(
        hidden_size=H, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=EPS, vocab_size=V, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        num_target_layers=tgt.config.num_hidden_layers,
        dflash_config={"block_size": block, "mask_token_id": 5, "target_layer_ids": layer_ids})
    model = DFlashDraftModel(cfg).float().eval()
    r.fill(model)
    d2t, _ = draft_vocab(r)
    draft_ids = torch.arange(DV) + d2t
    heads = {"lm_head.weight": r.linear(DV, H), "markov_head.markov_w1.weight": r.n(V, rank),
             "markov_head.markov_w2.weight": r.linear(DV, rank), "confidence_head.proj.weight": r.linear(1, H + rank),
             "confidence_head.proj.bias": r.bias(1)}
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items() if "rotary" not in k}
    save_file({**tensors, **heads, "d2t": d2t.to(torch.int64)}, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["DSparkDraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": EPS, "rope_theta": 10000.0, "vocab_size": V, "block_size": block, "mask_token_id": 5,
        "target_layer_ids": layer_ids, "logits_start": 0, "markov_rank": rank, "enable_confidence_head": True,
        "confidence_head_with_markov": True, "final_logit_softcapping": cap, "draft_vocab_size": DV,
        "num_target_layers": tgt.config.num_hidden_layers}, indent=2) + "\n")
    w = load_file(d / "model.safetensors")  # compute the heads from the file

    def rows(context, th, cache, first):  # [block, H]: every row drafts (logits_start 0)
        start = len(context) - 1
        ids = torch.tensor([[context[-1]] + [5] * (block - 1)])
        hidden = model(target_hidden=th, noise_embedding=_raw_input_embeddings(tgt.model, ids),
                       position_ids=torch.arange(first, start + block)[None], past_key_values=cache,
                       use_cache=cache is not None)[0, -block:, :]
        if cache is not None:
            _crop_to(cache, start)
        return hidden

    def draft(context, hidden):  # greedy, row by row after the previous token
        logits, drafts, confidences, previous = [], [], [], context[-1]
        for row in hidden:
            z = F.linear(row, w["lm_head.weight"])
            z = cap * torch.tanh(z / cap)
            code = w["markov_head.markov_w1.weight"][previous]
            z = z + F.linear(code, w["markov_head.markov_w2.weight"])
            conf = torch.sigmoid(F.linear(torch.cat([row, code]), w["confidence_head.proj.weight"],
                                          w["confidence_head.proj.bias"]))
            full = scatter_draft(z[None], d2t)[0]
            previous = int(draft_ids[int(z.argmax())])
            logits.append(full)
            drafts.append(previous)
            confidences.append(round(float(conf), 6))
        return drafts, torch.stack(logits), {"confidences": confidences}

    logits, drafts, worst = block_request(
        case, "dspark", "mlx-dspark 0.20.3 (DSparkDrafter on mlx's CPU backend), equal to dflash 0.1.0's block + "
        "independent torch heads", tgt, d, r, model, prompt_ids(seed), rows, draft)
    agree = check_with_mlx_dspark(d, tgt, model.target_layer_ids)
    return logits, drafts, f"3 steps, cached vs recomputed {worst:.1e}, mlx-dspark vs torch {agree:.1e}"


def check_with_mlx_dspark(d: Path, tgt: Target, layer_ids: list[int]) -> float:
    """Replays the written reference.json's steps with mlx-dspark's own drafter (load_drafter, f32,
    not quantized; its context cache, backbone, greedy Markov draft and confidence head), the
    target's embedding bound as mlx-dspark binds a reuse-embed head's; every step's logits must
    match the torch computation within TOL (relative to the step's largest logit) and its drafts
    and confidences exactly (to the 6 decimals written). Returns the largest difference."""
    import mlx.core as mx
    from dflash.model import extract_context_feature
    from mlx_dspark.load import load_drafter

    ref = json.loads((d / "reference.json").read_text())
    steps = [(ref["prompt_ids"], ref["draft_token_ids"], ref["logits"], ref["confidences"])]
    steps += [(s["context_ids"], s["draft_token_ids"], s["logits"], s["confidences"]) for s in ref["later_steps"]]
    drafter, config = load_drafter(str(d), quantize=False)
    embedding = mx.array(tgt.embed.numpy())
    drafter.bind_embed(lambda ids: embedding[ids])
    caches, fed, worst = drafter.make_ctx_cache(), 0, 0.0
    for context, want_drafts, want_logits, want_confidences in steps:
        with torch.no_grad():
            out = tgt.model(torch.tensor([context[:-1]]), output_hidden_states=True)
            th = extract_context_feature(out.hidden_states, layer_ids)
        drafter.update_context(mx.array(th[:, fed:].numpy()), fed, caches)
        fed = th.shape[1]
        start = len(context) - 1
        ids = mx.array([[context[-1]] + [config.mask_token_id] * (config.block_size - 1)])
        hidden = drafter.head_slice(drafter.backbone(drafter.embed(ids), start, caches), config.block_size)[0]
        base = drafter.compute_logits(hidden)
        drafts = drafter.sample_block(base, context[-1]).tolist()
        previous = mx.array([context[-1]] + drafts[:-1])
        biased = base + drafter.markov_head.step_bias(previous)
        confidences = mx.sigmoid(drafter.confidence_logits(hidden, previous)).tolist()
        full = torch.full((len(drafts), V), float("nan"))
        full[:, drafter._draft_to_target.tolist()] = torch.tensor(biased.tolist())
        want = torch.tensor([[float("nan") if x is None else x for x in row] for row in want_logits])
        scale = torch.nan_to_num(want).abs().max().item()
        diff = torch.nan_to_num(full - want).abs().max().item() / max(scale, 1.0)
        assert torch.equal(full.isnan(), want.isnan()), "draft vocabulary"
        assert drafts == want_drafts, (drafts, want_drafts)
        assert max(abs(a - b) for a, b in zip(confidences, want_confidences)) < 1e-5, (confidences, want_confidences)
        assert diff < TOL, f"mlx-dspark vs torch {diff}"
        worst = max(worst, diff)
    return worst


CASES = {
    "eagle_llama": lambda s: eagle1("eagle_llama", "llama", s),
    "eagle_qwen2": lambda s: eagle1("eagle_qwen2", "qwen2", s),
    "eagle3_llama_speculators": lambda s: eagle3_speculators(
        "eagle3_llama_speculators", s, DV, {"norm_before_residual": False}),
    "eagle3_qwen2_specforge": lambda s: eagle3_specforge("eagle3_qwen2_specforge", s),
    "eagle3_llama_speculators_options": lambda s: eagle3_speculators(
        "eagle3_llama_speculators_options", s, V, {"norm_before_residual": True, "fc_norm": True, "norm_output": True}),
    "mtp_qwen3_speculators": lambda s: mtp_speculators("mtp_qwen3_speculators", s),
    "mtp_llama_deepseek": lambda s: mtp_inside("mtp_llama_deepseek", "llama", s, "deepseek"),
    "mtp_qwen2_mimo": lambda s: mtp_inside("mtp_qwen2_mimo", "qwen2", s, "mimo"),
    "mlp_speculator_llama": lambda s: mlp_speculator("mlp_speculator_llama", "llama", s, 3, "speculator.", False, True),
    "mlp_speculator_qwen2": lambda s: mlp_speculator("mlp_speculator_qwen2", "qwen2", s, 4, "", True, False),
    "medusa_llama": lambda s: medusa("medusa_llama", "llama", s, 4, False),
    "medusa_qwen2_vllm": lambda s: medusa("medusa_qwen2_vllm", "qwen2", s, 3, True),
    # last, so the seeds of the cases above (1000 * (index + 1) + attempt) do not move
    "eagle3_llama_gguf": lambda s: eagle3_llama_gguf("eagle3_llama_gguf", s),
    "mtp_llama_deepseek_2layers": lambda s: mtp_two_layers("mtp_llama_deepseek_2layers", s),
    # dflash's defaults on a 2-layer target: one draft layer tapping layer 1's output (the last: after
    # the final norm), bidirectional blocks of 4
    "dflash_llama": lambda s: dflash("dflash_llama", "llama", s, 1, None, 4, {}),
    "dflash_qwen3_options": lambda s: dflash("dflash_qwen3_options", "qwen3", s, 2, [0, 1], 5, {
        "input_embedding_scale": 0.5, "output_multiplier": 1.5, "final_logit_softcapping": 20.0}),
    "dflash_qwen2_causal": lambda s: dflash("dflash_qwen2_causal", "qwen2", s, 1, [0], 4, {"is_causal": True}),
    "dspark_qwen3": lambda s: dspark("dspark_qwen3", "qwen3", s),
}
DERIVED = {"eagle3_llama_gguf"}  # re-encodes another case's committed files: no seed of its own


def main() -> None:
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    only = set(sys.argv[1:])
    rows = []
    for k, (case, build) in enumerate(CASES.items()):
        if only and case not in only:
            continue
        for attempt in range(1 if case in DERIVED else 20):  # redraw while a greedy choice is a near tie
            seed = None if case in DERIVED else 1000 * (k + 1) + attempt
            logits, drafts, checks = build(seed)
            gap = min(top_gap(row) for row in logits)
            if gap >= GAP:
                break
        else:
            raise SystemExit(f"{case}: no seed without a near tie")
        rows.append((case, seed, drafts, gap, checks))
    print(f"{'case':34} {'seed':>5} {'draft ids':18} {'min gap':>8}  checks")
    for case, seed, drafts, gap, checks in rows:
        print(f"{case:34} {'-' if seed is None else seed:>5} {str(drafts):18} {gap:8.4f}  {checks}")


if __name__ == "__main__":
    main()
