"""Write tests/golden/hf/<family>/: a tiny random model per family made by HF transformers from a
fixed seed (config.json, model.safetensors, tokenizer files), and transformers' own outputs for it
(golden.json: input ids, all-position logits of one forward, a greedy continuation with its KV
cache). tests/test_hf_golden.py loads each directory with specrs and compares; the suite reads only
these files.

Needs torch and transformers (not installed by the Makefile; the files are committed):
    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers tokenizers
    /tmp/hf/bin/python scripts/make_hf_golden.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

OUT = Path(__file__).resolve().parent.parent / "tests" / "golden" / "hf"
VOCAB = 256
SEQ = 24
NEW = 12

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    # Larger than transformers' 0.02 so logits spread and differences show.
    initializer_range=0.2,
)

# family -> (config class, model class, extra config, weight dtype)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, torch.float32),
    # A window shorter than the sequence, so the sliding window is exercised.
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}, torch.float32),
    # q/k/v biases; stored in bf16 to cover that dtype.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}, torch.bfloat16),
    # q/k norms and a head_dim that is not hidden / heads.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}, torch.float32),
    # Four norms per block, GELU, embedding scale, sliding/full layers with two RoPE bases,
    # query_pre_attn_scalar, tied embeddings.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16,
            "tie_word_embeddings": True,
        },
        torch.float32,
    ),
    # Fused qkv and gate_up, partial rotary.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5, "sliding_window": None}, torch.float32),
}


def write_tokenizer(directory: Path) -> None:
    """The numbered vocabulary "t0 t1 ...": token ids are what the tests feed."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "t1", "eos_token": "t2", "add_bos_token": False}, indent=1)
    )


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    rng = np.random.default_rng(0)
    input_ids = [int(x) for x in rng.integers(3, VOCAB, size=SEQ)]
    randomized: dict[str, list[str]] = {}
    for family, (config_cls, model_cls, extra, dtype) in FAMILIES.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**{**COMMON, **extra})
        config._attn_implementation = "eager"
        model = getattr(transformers, model_cls)(config).eval()
        # transformers starts biases at 0 and norm weights at 1 (or 0 for Gemma's offset): every
        # tensor it fills with one value gets random values from the seed, so a missed bias, a
        # missed offset or a swapped norm changes the logits.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if bool((p == p.flatten()[0]).all()):
                    p.add_(torch.randn_like(p) * 0.3)
                    randomized.setdefault(family, []).append(name)
        model = model.to(dtype)
        directory = OUT / family
        model.save_pretrained(directory, safe_serialization=True)
        write_tokenizer(directory)
        with torch.no_grad():
            ids = torch.tensor([input_ids])
            logits = model(ids).logits[0].float().numpy()  # [SEQ, VOCAB]
            generated = model.generate(
                ids[:, :16], max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW, eos_token_id=None
            )[0, 16:].tolist()
        golden = {
            "reference": f"transformers {transformers.__version__}, torch {torch.__version__}",
            "dtype": str(dtype).removeprefix("torch."),
            "input_ids": input_ids,
            "logits": [[round(float(x), 6) for x in row] for row in logits],
            "greedy_prompt_len": 16,
            "greedy_ids": generated,
        }
        (directory / "golden.json").write_text(json.dumps(golden))
        size = sum(f.stat().st_size for f in directory.iterdir())
        print(f"{family}: {size / 1e3:.0f} KB, logits scale {np.abs(logits).max():.2f}, greedy {generated}; "
              f"randomized {len(randomized[family])} constant tensors, e.g. {randomized[family][:4]}")


if __name__ == "__main__":
    main()
