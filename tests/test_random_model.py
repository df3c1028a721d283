"""The candle-ops Llama (what device="cuda" runs) through `Engine.random`, on the CPU here and on
CUDA when this is a CUDA build on a GPU machine (skipped otherwise), and the GPU check script's
CPU mode."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import specrs

TINY = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
PROMPT = [(i * 37 + 11) % 512 for i in range(20)]


class Replay:
    """Drafts the target's own greedy continuation, each token corrupted with probability
    1 - acceptance, so most steps verify several tokens and some reject."""

    def __init__(self, reference, prompt_len, acceptance, seed):
        self.reference, self.prompt_len, self.acceptance = reference, prompt_len, acceptance
        self.rng = random.Random(seed)

    def propose(self, context_ids, max_tokens):
        start = len(context_ids) - self.prompt_len
        return [
            t if self.rng.random() < self.acceptance else (t + 1) % TINY["vocab_size"]
            for t in self.reference[start : start + max_tokens]
        ]


@pytest.fixture(scope="module", params=["f32", "bf16", "q8_0"])
def random_engine(request):
    return specrs.Engine.random(TINY, seed=7, dtype=request.param)


def test_same_seed_same_weights_other_seed_other_weights():
    a = specrs.Engine.random(TINY, seed=1, dtype="f32").logits(PROMPT)
    b = specrs.Engine.random(TINY, seed=1, dtype="f32").logits(PROMPT)
    c = specrs.Engine.random(TINY, seed=2, dtype="f32").logits(PROMPT)
    assert np.array_equal(a, b)
    assert not np.allclose(a, c)
    assert a.shape == (len(PROMPT), TINY["vocab_size"]) and np.isfinite(a).all()


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculation_is_identical_on_the_candle_model(random_engine, k):
    params = specrs.SamplingParams(max_tokens=48, temperature=0.0)
    plain = random_engine.generate(PROMPT, params)
    assert plain.finish_reason == "length" and len(plain.token_ids) == 48
    config = {"method": "custom", "num_speculative_tokens": k, "adaptive_draft_length": False}
    spec = random_engine.generate(
        PROMPT, params, speculative_config=config, proposer=Replay(plain.token_ids, len(PROMPT), 0.8, seed=k)
    )
    assert spec.token_ids == plain.token_ids
    m = spec.metrics
    assert m["num_drafts"] > 0 and 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert m["num_forward_passes"] < plain.metrics["num_forward_passes"]
    for method in ("ngram", "suffix"):
        other = random_engine.generate(
            PROMPT * 2, params, speculative_config={"method": method, "num_speculative_tokens": k}
        )
        assert other.token_ids == random_engine.generate(PROMPT * 2, params).token_ids


def test_seeded_sampling_is_reproducible_with_speculation():
    engine = specrs.Engine.random(TINY, seed=3, dtype="f32")
    params = specrs.SamplingParams(max_tokens=32, temperature=0.8, seed=11)
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    runs = [engine.generate(PROMPT * 2, params, speculative_config=config).token_ids for _ in range(2)]
    assert runs[0] == runs[1]
    other = specrs.SamplingParams(max_tokens=32, temperature=0.8, seed=12)
    assert engine.generate(PROMPT * 2, other, speculative_config=config).token_ids != runs[0]


def test_numbered_tokenizer_and_info():
    engine = specrs.Engine.random(TINY, seed=0, dtype="bf16")
    assert engine.tokenizer.encode("t1 t22 t3") == [1, 22, 3]
    assert engine.tokenizer.decode([4, 5]) == "t4 t5"
    info = engine.info()
    assert (info["architecture"], info["vocab_size"], info["num_layers"], info["device"]) == ("llama", 512, 3, "Cpu")
    # bf16 weights (2 bytes each) of every matrix and the embedding.
    per_layer = 2 * 256 * 256 + 2 * 64 * 256 + 3 * 512 * 256
    assert info["weight_bytes"] == 2 * (3 * per_layer + 2 * 512 * 256)


def test_bad_random_configs_name_the_fix():
    with pytest.raises(specrs.ConfigError, match="hiden_size"):
        specrs.Engine.random({**TINY, "hiden_size": 3})
    with pytest.raises(specrs.ConfigError, match="unknown dtype 'f8'"):
        specrs.Engine.random(TINY, dtype="f8")
    with pytest.raises(specrs.ConfigError, match="divisible by 256"):
        specrs.Engine.random({**TINY, "intermediate_size": 384}, dtype="q4_k")
    with pytest.raises(specrs.ModelLoadError, match="inconsistent attention shape"):
        specrs.Engine.random({**TINY, "num_attention_heads": 7})
    with pytest.raises(specrs.ConfigError, match="quantized_self"):
        specrs.Engine.random(TINY, dtype="f32").generate(
            PROMPT, specrs.SamplingParams(max_tokens=4), speculative_config={"method": "quantized_self"}
        )
    with pytest.raises(specrs.ConfigError, match="cuda:N"):
        specrs.Engine.random(TINY, device="cuda:x")


def test_copy_bandwidth():
    rate = specrs._specrs.copy_bandwidth("cpu", 64 << 20, 3)
    assert 1e8 < rate < 1e13
    with pytest.raises(specrs.ConfigError, match="1 MiB"):
        specrs._specrs.copy_bandwidth("cpu", 1000, 3)


def _cuda_or_skip():
    try:
        specrs._specrs.copy_bandwidth("cuda", 1 << 20, 1)
    except specrs.DeviceError as e:
        pytest.skip(f"no CUDA here: {e}")


def test_cuda_device_errors_name_the_build_or_the_device():
    try:
        specrs.Engine.random(TINY, device="cuda")
    except specrs.DeviceError as e:
        assert "CUDA build" in str(e) or "cannot open CUDA device" in str(e), str(e)
    else:
        pytest.skip("CUDA is available here")


@pytest.mark.parametrize("dtype,tolerance", [("f32", 1e-3), ("bf16", 5e-2), ("q8_0", 5e-2)])
def test_cuda_logits_match_the_cpu(dtype, tolerance):
    _cuda_or_skip()
    cpu = specrs.Engine.random(TINY, seed=5, dtype=dtype).logits(PROMPT)
    gpu = specrs.Engine.random(TINY, seed=5, dtype=dtype, device="cuda").logits(PROMPT)
    assert np.abs(cpu - gpu).max() <= tolerance * np.abs(cpu).max()
    assert (cpu.argmax(axis=1) == gpu.argmax(axis=1)).mean() >= 0.9


def test_cuda_greedy_speculation_is_identical():
    _cuda_or_skip()
    engine = specrs.Engine.random(TINY, seed=5, dtype="f32", device="cuda")
    params = specrs.SamplingParams(max_tokens=48, temperature=0.0)
    plain = engine.generate(PROMPT, params).token_ids
    config = {"method": "custom", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    spec = engine.generate(PROMPT, params, speculative_config=config, proposer=Replay(plain, len(PROMPT), 0.8, 1))
    assert spec.token_ids == plain


def test_gpu_check_script_runs_its_cpu_parts(tmp_path):
    script = Path(__file__).parent.parent / "scripts" / "gpu_check.py"
    run = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--tokens", "24", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["device"] == "cpu" and report["b"] == {"skipped": "no CUDA device"}
    assert all(r["ok"] for fmt, r in report["a"].items() if fmt != "greedy_identity")
    assert all(g["identical"] and g["num_drafts"] > 0 for g in report["a"]["greedy_identity"].values())
    rows = report["c"]["rows"]
    assert [(r["a"], r["k"]) for r in rows] == [(a, k) for a in (0.5, 0.7, 0.9) for k in (2, 4, 8)]
    assert all(r["matches_baseline"] for r in rows)
    assert run.stdout.rstrip().splitlines()[-1].startswith("checks:")
