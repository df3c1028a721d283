"""Continuous batching from Python: `Engine.generate` over a list of prompts returns, in order,
exactly what each prompt gets alone (greedy and seeded sampling, with and without speculation); the
`Scheduler` binding adds, aborts and steps requests; `stream()` keeps working from several threads
at once. (The Rust tests in crates/specrs-core/tests/continuous_batching.rs cover preemption and
the draft budget; tests/test_serve.py the server.)"""

from __future__ import annotations

import threading

import pytest

import specrs
from specrs import _specrs
from specrs.errors import ConfigError, ContextLengthError

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PROMPTS = [
    "The capital of France is",
    [{"role": "user", "content": "List the days of the week."}],
    "Speculative decoding verifies a draft in one forward pass. " * 8,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    [{"role": "user", "content": "Count from one to ten in words."}],
]


def _params(i: int) -> specrs.SamplingParams:
    if i % 2:
        return specrs.SamplingParams(max_tokens=20 + i, temperature=0.8, top_p=0.95, seed=40 + i)
    return specrs.SamplingParams(max_tokens=20 + i, temperature=0.0)


@pytest.mark.parametrize("speculative_config", [False, NGRAM, {"method": "suffix", "num_speculative_tokens": 4}],
                         ids=["off", "ngram", "suffix"])
def test_generate_a_list_matches_each_alone_in_order(engine, capsys, speculative_config):
    params = [_params(i) for i in range(len(PROMPTS))]
    results = engine.generate(PROMPTS, params, speculative_config=speculative_config)
    assert len(results) == len(PROMPTS)
    for prompt, p, batched in zip(PROMPTS, params, results):
        alone = engine.generate(prompt, p, speculative_config=speculative_config)
        assert batched.token_ids == alone.token_ids
        assert batched.text == alone.text and batched.finish_reason == alone.finish_reason
        assert batched.prompt_token_ids == engine.prompt_token_ids(prompt)
    assert f"{len(PROMPTS)}/{len(PROMPTS)} requests" in capsys.readouterr().err  # the progress bar


def test_generate_a_list_takes_one_params_for_all_and_refuses_a_wrong_count(engine, capsys):
    ids = [engine.tokenizer.encode(p) for p in ("Hello", "One, two, three,")]
    results = engine.generate(ids, specrs.SamplingParams(max_tokens=6), progress=False)
    assert [r.token_ids for r in results] == [engine.generate(i, specrs.SamplingParams(max_tokens=6)).token_ids
                                              for i in ids]
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="2 prompts"):
        engine.generate(["a", "b"], [specrs.SamplingParams()] * 3)
    with pytest.raises(ConfigError, match="list of prompts"):
        engine.generate("a", [specrs.SamplingParams()])
    with pytest.raises(ConfigError, match="draft budget"):
        engine.generate(["a", "b"], draft_budget="sometimes")
    # A list of ints (or of chat messages) is one prompt, not a batch.
    assert isinstance(engine.generate(ids[0], specrs.SamplingParams(max_tokens=2)), specrs.GenerationResult)


def test_the_scheduler_binding_adds_aborts_and_steps(engine):
    scheduler = _specrs.Scheduler(engine._inner, max_num_seqs=2, max_kv_tokens=400)
    prompt = engine.prompt_token_ids([{"role": "user", "content": "Tell me a story about a dragon."}])
    greedy = specrs.SamplingParams(max_tokens=30, temperature=0.0)
    for request_id in range(3):
        scheduler.add(request_id, prompt, greedy, None, None)
    with pytest.raises(ConfigError, match="already"):
        scheduler.add(0, prompt, greedy, None, None)
    with pytest.raises(ContextLengthError, match="max_kv_tokens"):
        scheduler.add(9, prompt, specrs.SamplingParams(max_tokens=1000), None, None)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    ends: dict[int, dict] = {}
    outputs, report = scheduler.step()
    assert report["num_running"] == 2 and report["num_waiting"] == 1  # max_num_seqs
    assert scheduler.abort(1) and not scheduler.abort(1)
    while True:
        for output in outputs:
            assert output["error"] is None
            tokens[output["request_id"]] += output["token_ids"]
            if output["finished"] is not None:
                ends[output["request_id"]] = output["finished"]
        if not scheduler.has_unfinished:
            break
        outputs, report = scheduler.step()
    alone = engine.generate(prompt, greedy).token_ids
    assert tokens[0] == tokens[2] == alone == ends[0]["token_ids"]
    assert ends[1]["finish_reason"] == "abort" and ends[1]["token_ids"] == alone[:len(ends[1]["token_ids"])]
    totals = scheduler.totals()
    assert totals["num_steps"] > 0 and totals["num_rows"] >= 2 * len(alone)
    curve, source = scheduler.cost_curve()
    assert len(curve) >= 1 and source


def test_streams_from_several_threads_at_once(engine):
    """Each thread iterates its own stream; the engine serves them concurrently, each exactly as alone."""
    prompts = ["Hello, my name is", "The weather today", "Once upon a time", "def add(a, b):"]
    params = specrs.SamplingParams(max_tokens=24, temperature=0.0)
    texts: dict[int, str] = {}
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            texts[i] = "".join(engine.stream(prompts[i], params, speculative_config=NGRAM))
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, prompt in enumerate(prompts):
        assert texts[i] == engine.generate(prompt, params).text
