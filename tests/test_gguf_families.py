"""Every GGUF family against llama.cpp: tests/golden/gguf/ holds the tiny random models of
tests/golden/hf/ converted to Q8_0 GGUF by llama.cpp's own converter, and llama.cpp's logits for
them (written by scripts/make_gguf_golden.py with llama-cpp-python 0.3.36).

This is what the HF goldens cannot show: that specrs reads llama.cpp's files of each family
(tensor names, q/k permutation, norm offsets, biases, fused projections, metadata keys) as
llama.cpp does. It does, bit for bit: every logit equals llama.cpp's single-token evaluation.
"""

import json
from pathlib import Path

import numpy as np
import pytest

import specrs

GGUF_DIR = Path(__file__).parent / "golden" / "gguf"
# family -> general.architecture llama.cpp's converter writes (Mistral's HF checkpoints become llama).
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    name = request.param
    golden = json.loads((GGUF_DIR / f"{name}-q8_0.json").read_text())
    return name, golden, specrs.Engine(str(GGUF_DIR / f"{name}-q8_0.gguf"))


def test_logits_equal_llamacpp_bit_for_bit(family):
    name, golden, engine = family
    assert engine.info()["architecture"] == FAMILIES[name]
    ours = engine.logits(golden["input_ids"])
    reference = np.asarray(golden["logits_stepwise"], dtype=np.float32)
    np.testing.assert_array_equal(ours, reference, err_msg=name)
    assert list(ours.argmax(axis=1)) == golden["top1_batched"]


def test_greedy_speculation_is_identical(family):
    name, golden, engine = family
    params = specrs.SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = golden["input_ids"][:6] * 3  # repeats, so the suffix tree has drafts to offer
    plain = engine.generate(prompt, params, speculative_config=False).token_ids
    config = {"method": "suffix", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    spec = engine.generate(prompt, params, speculative_config=config)
    assert spec.token_ids == plain and spec.metrics["num_drafts"] > 0, (name, spec.metrics["num_drafts"])
