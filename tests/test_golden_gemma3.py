"""Gemma 3 270M Q4_K_M against llama.cpp on the same GGUF (tests/golden/gemma3.json, written by
`scripts/make_golden.py --model gemma3` with llama-cpp-python 0.3.36).

llama.cpp computes one token and a batch with different kernels, and on this model the two
disagree visibly: evaluated one token at a time, llama.cpp's teacher-forced top-1 matches its own
batched evaluation on 97.0% of positions, and its greedy continuations match its usual generation
(prompt in one batch, then single tokens) on 3 of 14 prompts (`llama_cpp_self_agreement`). specrs
computes every token, in any batch, with llama.cpp's single-token arithmetic (model/cpu_decoder.rs),
so it is compared with llama.cpp evaluating one token at a time, where it agrees bit for bit; and
against llama.cpp's other modes it departs exactly where llama.cpp departs from itself.
"""

import json
from pathlib import Path

import numpy as np
import pytest

import specrs

GOLDEN = json.loads((Path(__file__).parent / "golden" / "gemma3.json").read_text(encoding="utf-8"))
PROMPTS = GOLDEN["prompts"]
SELF = GOLDEN["llama_cpp_self_agreement"]


@pytest.fixture(scope="module")
def gemma():
    return specrs.Engine("gemma3-270m")


@pytest.fixture(scope="module")
def teacher_forced(gemma):
    """specrs's logits at the 64 teacher-forced positions of each prompt, one forward each."""
    out = {}
    for p in PROMPTS:
        logits = gemma.logits(p["prompt_ids"] + p["greedy_ids"])
        out[p["name"]] = logits[len(p["prompt_ids"]) - 1 :][: GOLDEN["num_new_tokens"]]
    return out


@pytest.fixture(scope="module")
def greedy(gemma):
    """specrs's greedy 64-token continuation of each prompt (EOS ignored)."""
    params = specrs.SamplingParams(max_tokens=GOLDEN["num_new_tokens"], ignore_eos=True)
    return {p["name"]: gemma.generate(p["prompt_ids"], params).token_ids for p in PROMPTS}


def test_golden_covers_base_model_prompts():
    assert len(PROMPTS) >= 12 and not any(p["name"].endswith("_chat") for p in PROMPTS)


def test_tokenization_is_identical_to_llamacpp(gemma):
    for p in PROMPTS:
        assert gemma.tokenizer.encode(p["text"]) == p["prompt_ids"], p["name"]
        assert gemma.tokenizer.decode(p["prompt_ids"], skip_special_tokens=True) == p["text"]


def test_teacher_forced_logits_equal_llamacpp_single_token_evaluation(teacher_forced):
    agree = total = 0
    max_diff = 0.0
    for p in PROMPTS:
        for row, ref in zip(teacher_forced[p["name"]], p["teacher_forced_top_stepwise"]):
            agree += int(np.argmax(row)) == ref["ids"][0]
            total += 1
            max_diff = max(max_diff, max(abs(float(row[t]) - v) for t, v in zip(ref["ids"], ref["logits"])))
    print(f"\ntop-1 agreement {agree}/{total}; max |logit diff| on llama.cpp's top-5: {max_diff}")
    assert agree / total >= 0.99
    # Bitwise: any difference at all means a kernel no longer rounds like llama.cpp's.
    assert max_diff == 0.0


def test_greedy_continuations_equal_llamacpp_single_token_decoding(greedy):
    identical = sum(greedy[p["name"]] == p["greedy_ids_stepwise"] for p in PROMPTS)
    print(f"\ngreedy continuations identical to llama.cpp's (one token at a time): {identical}/{len(PROMPTS)}")
    assert identical == len(PROMPTS)


def test_departs_from_llamacpp_batches_exactly_where_llamacpp_does(greedy, teacher_forced):
    """Against llama.cpp's batched teacher forcing and its usual generation, specrs agrees exactly
    as often as llama.cpp's single-token mode does."""
    top1 = [
        int(np.argmax(row)) == ref["ids"][0]
        for p in PROMPTS
        for row, ref in zip(teacher_forced[p["name"]], p["teacher_forced_top"])
    ]
    agreement = sum(top1) / len(top1)
    identical = sum(greedy[p["name"]] == p["greedy_ids"] for p in PROMPTS)
    print(f"\nagainst llama.cpp's batches: teacher-forced top-1 {agreement:.4f}, greedy identical {identical}/{len(PROMPTS)}"
          f" (llama.cpp against itself: {SELF['teacher_forced_top1_batched_vs_stepwise']:.4f}, "
          f"{SELF['greedy_identical_stepwise_vs_greedy_ids']}/{SELF['num_prompts']})")
    assert agreement == SELF["teacher_forced_top1_batched_vs_stepwise"]
    assert identical == SELF["greedy_identical_stepwise_vs_greedy_ids"]
