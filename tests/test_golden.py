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


def test_teacher_forced_top1_agreement_with_llamacpp(engine):
    agree = total = 0
    max_diff = 0.0
    for p in PROMPTS:
        ids = p["prompt_ids"] + p["greedy_ids"]
        logits = engine.logits(ids)
        start = len(p["prompt_ids"]) - 1
        for i, ref in enumerate(p["teacher_forced_top"]):
            row = logits[start + i]
            agree += int(np.argmax(row)) == ref["ids"][0]
            total += 1
            max_diff = max(max_diff, max(abs(float(row[t]) - l) for t, l in zip(ref["ids"], ref["logits"])))
    print(f"\ntop-1 agreement {agree}/{total} = {agree / total:.4f}; max |logit diff| on llama.cpp's top-5: {max_diff:.4f}")
    assert agree / total >= 0.99
    # Both quantize activations to int8 the same way; a larger gap would mean a modelling bug.
    assert max_diff < 1.0


def test_greedy_continuations_match_llamacpp(engine):
    matches = []
    for p in PROMPTS:
        out = engine.generate(p["prompt_ids"], specrs.SamplingParams(max_tokens=GOLDEN["num_new_tokens"], ignore_eos=True))
        matches.append(out.token_ids == p["greedy_ids"])
        if not matches[-1]:
            first = next(i for i, (a, b) in enumerate(zip(out.token_ids, p["greedy_ids"])) if a != b)
            print(f"\n{p['name']}: first difference at generated token {first}")
    print(f"\ngreedy continuations identical: {sum(matches)}/{len(matches)}")
    assert sum(matches) >= len(matches) * 10 / 12
