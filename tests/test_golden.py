"""specrs against llama.cpp on the same GGUF: SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M.

tests/golden/{smollm2,gemma3}.json were written by scripts/make_golden.py with llama-cpp-python
0.3.36; this suite only reads them.

llama.cpp computes one token and a batch with different kernels, and the two disagree visibly on
these small models: evaluated one token at a time, llama.cpp's teacher-forced top-1 matches its
own batched evaluation on 97.4% (SmolLM2) and 97.2% (Gemma 3) of positions, and its greedy
continuations match its usual generation (prompt in one batch, then single tokens) on 7 of 14 and 4
of 15 prompts (`llama_cpp_self_agreement`). specrs computes every token, in any batch, with
llama.cpp's single-token arithmetic (model/cpu/decoder.rs), so it is compared with llama.cpp
evaluating one token at a time, where it agrees bit for bit; against llama.cpp's other modes it
departs exactly where llama.cpp departs from itself.
"""

import json
from pathlib import Path

import numpy as np
import pytest

import specrs

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDENS = {name: json.loads((GOLDEN_DIR / f"{name}.json").read_text(encoding="utf-8")) for name in ("smollm2", "gemma3")}
ENGINES = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}


@pytest.fixture(scope="module", params=list(GOLDENS))
def model(request):
    """(name, golden, engine) per model, one engine each."""
    name = request.param
    return name, GOLDENS[name], specrs.Engine(ENGINES[name])


@pytest.fixture(scope="module")
def teacher_forced(model):
    """specrs's logits at the teacher-forced positions of each prompt, one forward each."""
    _, golden, engine = model
    out = {}
    for p in golden["prompts"]:
        logits = engine.logits(p["prompt_ids"] + p["greedy_ids"])
        out[p["name"]] = logits[len(p["prompt_ids"]) - 1 :][: golden["num_new_tokens"]]
    return out


@pytest.fixture(scope="module")
def greedy(model):
    """specrs's greedy continuation of each prompt (EOS ignored)."""
    _, golden, engine = model
    params = specrs.SamplingParams(max_tokens=golden["num_new_tokens"], ignore_eos=True)
    return {p["name"]: engine.generate(p["prompt_ids"], params).token_ids for p in golden["prompts"]}


def test_golden_covers_the_required_prompts():
    names = {p["name"] for p in GOLDENS["smollm2"]["prompts"]}
    assert len(names) >= 12 and {"english", "turkish", "chinese", "emoji", "code_python"} <= names
    # Gemma 3 270M is a base model: plain text only, one prompt past its 512-token sliding window.
    gemma = GOLDENS["gemma3"]["prompts"]
    assert len(gemma) >= 12 and not any(p["name"].endswith("_chat") for p in gemma)
    assert max(len(p["prompt_ids"]) for p in gemma) > 512


def test_tokenization_is_identical_to_llamacpp(model):
    name, golden, engine = model
    for p in golden["prompts"]:
        assert engine.tokenizer.encode(p["text"]) == p["prompt_ids"], (name, p["name"])
        # Gemma's base-model prompts carry no special tokens besides BOS.
        assert engine.tokenizer.decode(p["prompt_ids"], skip_special_tokens=name == "gemma3") == p["text"]


def test_teacher_forced_logits_equal_llamacpp_single_token_evaluation(model, teacher_forced):
    name, golden, _ = model
    agree = total = 0
    max_diff = 0.0
    for p in golden["prompts"]:
        for row, ref in zip(teacher_forced[p["name"]], p["teacher_forced_top_stepwise"]):
            agree += int(np.argmax(row)) == ref["ids"][0]
            total += 1
            max_diff = max(max_diff, max(abs(float(row[t]) - v) for t, v in zip(ref["ids"], ref["logits"])))
    print(f"\n{name}: top-1 agreement {agree}/{total}; max |logit diff| on llama.cpp's top-5: {max_diff}")
    assert agree / total >= 0.99
    # Bitwise: any difference at all means a kernel no longer rounds like llama.cpp's.
    assert max_diff == 0.0


def test_greedy_continuations_equal_llamacpp_single_token_decoding(model, greedy):
    name, golden, _ = model
    identical = sum(greedy[p["name"]] == p["greedy_ids_stepwise"] for p in golden["prompts"])
    print(f"\n{name}: greedy continuations identical to llama.cpp's (one token at a time): "
          f"{identical}/{len(golden['prompts'])}")
    assert identical == len(golden["prompts"])


def test_departs_from_llamacpp_batches_exactly_where_llamacpp_does(model, teacher_forced, greedy):
    """Against llama.cpp's batched teacher forcing, its usual generation and its all-batched
    generation, specrs agrees exactly as often as llama.cpp's single-token mode does."""
    name, golden, _ = model
    prompts, self_agreement = golden["prompts"], golden["llama_cpp_self_agreement"]
    top1 = [
        int(np.argmax(row)) == ref["ids"][0]
        for p in prompts
        for row, ref in zip(teacher_forced[p["name"]], p["teacher_forced_top"])
    ]
    agreement = sum(top1) / len(top1)
    usual = sum(greedy[p["name"]] == p["greedy_ids"] for p in prompts)
    batched = sum(greedy[p["name"]] == p["greedy_ids_batched"] for p in prompts)
    print(f"\n{name} against llama.cpp's batches: teacher-forced top-1 {agreement:.4f}, greedy identical to its "
          f"usual generation {usual}/{len(prompts)}, to its all-batched one {batched}/{len(prompts)}; "
          f"llama.cpp against itself: {self_agreement}")
    assert agreement == self_agreement["teacher_forced_top1_batched_vs_stepwise"]
    assert usual == self_agreement["greedy_identical_stepwise_vs_greedy_ids"]
    assert batched == sum(p["greedy_ids_stepwise"] == p["greedy_ids_batched"] for p in prompts)
