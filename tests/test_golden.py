"""specrs against llama.cpp on the same GGUF (SmolLM2-135M-Instruct Q4_1).

tests/golden/smollm2.json was written by scripts/make_golden.py with llama-cpp-python; this suite
only reads it.
"""

import json
from pathlib import Path

import numpy as np
import pytest

import specrs

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2.json").read_text(encoding="utf-8"))
PROMPTS = GOLDEN["prompts"]


def test_golden_covers_the_required_prompts():
    assert len(PROMPTS) >= 12
    names = {p["name"] for p in PROMPTS}
    assert {"english", "turkish", "chinese", "emoji", "code_python"} <= names


@pytest.mark.parametrize("prompt", PROMPTS, ids=[p["name"] for p in PROMPTS])
def test_tokenization_is_identical_to_llamacpp(engine, prompt):
    assert engine.tokenizer.encode(prompt["text"]) == prompt["prompt_ids"]


def test_detokenization_round_trips_the_prompts(engine):
    for p in PROMPTS:
        assert engine.tokenizer.decode(p["prompt_ids"], skip_special_tokens=False) == p["text"]


def teacher_forced_agreement(engine, prompts=PROMPTS):
    """(top-1 agreement, max |logit diff| on llama.cpp's top-5) over every teacher-forced position."""
    agree = total = 0
    max_diff = 0.0
    for p in prompts:
        ids = p["prompt_ids"] + p["greedy_ids"]
        logits = engine.logits(ids)
        start = len(p["prompt_ids"]) - 1
        for i, ref in enumerate(p["teacher_forced_top"]):
            row = logits[start + i]
            agree += int(np.argmax(row)) == ref["ids"][0]
            total += 1
            max_diff = max(max_diff, max(abs(float(row[t]) - l) for t, l in zip(ref["ids"], ref["logits"])))
    print(f"\ntop-1 agreement {agree}/{total} = {agree / total:.4f}; max |logit diff| on llama.cpp's top-5: {max_diff:.4f}")
    return agree / total, max_diff


def _common_prefix(a, b):
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    return same


def _greedy(engine, prompt):
    params = specrs.SamplingParams(max_tokens=GOLDEN["num_new_tokens"], ignore_eos=True)
    return engine.generate(prompt["prompt_ids"], params).token_ids


def test_teacher_forced_top1_agreement_with_llamacpp(engine):
    agreement, max_diff = teacher_forced_agreement(engine)
    assert agreement >= 0.99
    # specrs reproduces llama.cpp's CPU arithmetic (README, "Numerics"); on this model the logits
    # have been bitwise equal, so any visible gap means a kernel changed.
    assert max_diff < 0.05


def test_greedy_continuations_match_llamacpp(engine):
    """Against llama.cpp's batched arithmetic (prefill / verification kernels), which specrs uses
    for every forward, one token or many."""
    identical = 0
    for p in PROMPTS:
        ours = _greedy(engine, p)
        identical += ours == p["greedy_ids_batched"]
        if ours != p["greedy_ids_batched"]:
            print(f"\n{p['name']}: first difference at token {_common_prefix(ours, p['greedy_ids_batched'])}")
    print(f"\ngreedy continuations identical to llama.cpp (batched kernels): {identical}/{len(PROMPTS)}")
    assert identical >= len(PROMPTS) * 10 / 12


def test_llamacpp_token_by_token_decoding_drifts_from_its_own_batches(engine):
    """llama.cpp decodes a single token with other kernels than a batch, so its plain greedy
    output differs from its batched one. specrs has one arithmetic for both; it departs from
    llama.cpp's token-by-token output exactly where llama.cpp departs from itself."""
    agree_fully = 0
    for p in PROMPTS:
        ours = _greedy(engine, p)
        llama_self = _common_prefix(p["greedy_ids"], p["greedy_ids_batched"])
        assert _common_prefix(ours, p["greedy_ids"]) == llama_self, p["name"]
        agree_fully += ours == p["greedy_ids"]
    print(f"\nidentical to llama.cpp's token-by-token greedy output: {agree_fully}/{len(PROMPTS)}")
