"""Continuous batching from Python: `Engine.generate` over a list of prompts returns, in order,
exactly what each prompt gets alone (greedy and seeded sampling, with and without speculation); the
`Scheduler` binding adds, aborts and steps requests; `stream()` keeps working from several threads
at once. (The Rust tests in crates/specrs-core/tests/continuous_batching.rs cover preemption and
the draft budget; tests/test_serve.py the server.)"""

from __future__ import annotations

import threading
from pathlib import Path

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
    results = engine.generate(ids, specrs.SamplingParams(temperature=0, max_tokens=6), progress=False)
    greedy = specrs.SamplingParams(temperature=0, max_tokens=6)
    assert [r.token_ids for r in results] == [engine.generate(i, greedy).token_ids for i in ids]
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="2 prompts"):
        engine.generate(["a", "b"], [specrs.SamplingParams()] * 3)
    with pytest.raises(ConfigError, match="list of prompts"):
        engine.generate("a", [specrs.SamplingParams()])
    with pytest.raises(ConfigError, match="draft budget"):
        engine.generate(["a", "b"], draft_budget="sometimes")
    # A list of ints (or of chat messages) is one prompt, not a batch.
    one = engine.generate(ids[0], specrs.SamplingParams(temperature=0, max_tokens=2))
    assert isinstance(one, specrs.GenerationResult)


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


# ---------------------------------------------------------------------------------------------
# n > 1: samples of one prompt sharing its prefill (Engine.generate_samples, Scheduler.add_samples)

SAMPLE_PROMPT = [{"role": "user", "content": "Write a short poem about the sea and the wind. " * 6}]


@pytest.mark.parametrize("speculative_config", [False, NGRAM, {"method": "suffix", "num_speculative_tokens": 4}],
                         ids=["off", "ngram", "suffix"])
def test_samples_equal_each_seeded_request_alone(engine, speculative_config):
    """Sample i is what a request with seed + i gets alone (vLLM's seeds), whatever shares its prefill."""
    params = specrs.SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11, n=4)
    samples = engine.generate_samples(SAMPLE_PROMPT, params, speculative_config=speculative_config)
    assert len(samples) == 4
    for i, sample in enumerate(samples):
        alone = engine.generate(SAMPLE_PROMPT, specrs.SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95,
                                                                      seed=11 + i),
                                speculative_config=speculative_config)
        assert sample.token_ids == alone.token_ids and sample.text == alone.text
        assert sample.prompt_token_ids == alone.prompt_token_ids
    assert len({tuple(s.token_ids) for s in samples}) > 1, "four samples at T=0.9 all the same"


def test_greedy_samples_are_all_plain_decoding(engine):
    samples = engine.generate_samples(SAMPLE_PROMPT, specrs.SamplingParams(temperature=0, max_tokens=16, n=3),
                                      speculative_config=NGRAM)
    plain = engine.generate(SAMPLE_PROMPT, specrs.SamplingParams(temperature=0, max_tokens=16),
                            speculative_config=False)
    assert [s.token_ids for s in samples] == [plain.token_ids] * 3


def _run(scheduler) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    while scheduler.has_unfinished:
        outputs, _ = scheduler.step()
        for output in outputs:
            assert output["error"] is None
            tokens.setdefault(output["request_id"], []).extend(output["token_ids"])
    return tokens


def test_samples_copy_the_prompt_cache_instead_of_computing_it(engine):
    prompt = engine.prompt_token_ids(SAMPLE_PROMPT)
    params = specrs.SamplingParams(max_tokens=8, temperature=0.7, seed=3, n=3)
    shared = _specrs.Scheduler(engine._inner)
    shared.add_samples([10, 11, 12], prompt, params, None, None)
    shared_tokens = _run(shared)
    totals = shared.totals()
    # Samples 1 and 2 copy every prompt position but the last, which each feeds for its own first token.
    assert totals["num_shared_prompt_tokens"] == 2 * (len(prompt) - 1)
    alone = _specrs.Scheduler(engine._inner)
    for i in range(3):
        alone.add(i, prompt, specrs.SamplingParams(max_tokens=8, temperature=0.7, seed=3 + i), None, None)
    alone_tokens = _run(alone)
    assert [shared_tokens[10 + i] for i in range(3)] == [alone_tokens[i] for i in range(3)]
    assert alone.totals()["num_shared_prompt_tokens"] == 0
    assert totals["num_rows"] == alone.totals()["num_rows"] - 2 * (len(prompt) - 1)


def test_samples_of_a_head_prefill_on_their_own(engine):
    """A hidden-state head needs the target's hidden rows of the prompt, which a copied cache does
    not give it: its samples are prefilled like any request (same tokens, nothing shared)."""
    head = {"method": "eagle3", "num_speculative_tokens": 3}
    config_json, _ = engine._speculation(head, None)
    prompt = engine.prompt_token_ids(SAMPLE_PROMPT)
    scheduler = _specrs.Scheduler(engine._inner)
    scheduler.add_samples([0, 1], prompt, specrs.SamplingParams(temperature=0, max_tokens=8, n=2), config_json, None)
    tokens = _run(scheduler)
    assert scheduler.totals()["num_shared_prompt_tokens"] == 0
    plain = engine.generate(SAMPLE_PROMPT, specrs.SamplingParams(temperature=0, max_tokens=8), speculative_config=False)
    assert tokens[0] == tokens[1] == plain.token_ids


def test_samples_are_refused_where_one_result_is_returned_and_checked_together(engine):
    with pytest.raises(ConfigError, match="generate_samples"):
        engine.generate("Hello", specrs.SamplingParams(n=2))
    with pytest.raises(ConfigError, match="generate_samples"):
        engine.generate(["Hello", "Hi"], specrs.SamplingParams(n=2), progress=False)
    for bad in (0, 129):
        with pytest.raises(ConfigError, match="n \\(samples"):
            specrs.SamplingParams(n=bad)
    assert specrs.SamplingParams(n=3).n == 3 and "n=3" in repr(specrs.SamplingParams(n=3))
    scheduler = _specrs.Scheduler(engine._inner, max_kv_tokens=300)
    prompt = engine.tokenizer.encode("Hello")
    with pytest.raises(ConfigError, match="one id"):
        scheduler.add_samples([0, 1, 2], prompt, specrs.SamplingParams(n=2), None, None)
    with pytest.raises(ConfigError, match="already in use"):
        scheduler.add_samples([4, 4], prompt, specrs.SamplingParams(n=2), None, None)
    with pytest.raises(ContextLengthError, match="max_kv_tokens"):
        scheduler.add_samples([5, 6], prompt, specrs.SamplingParams(n=2, max_tokens=1000), None, None)
    assert not scheduler.has_unfinished  # nothing was queued by the refused calls


def test_a_paged_engine_generates_what_a_contiguous_one_does_within_its_pool(engine):
    # 16 blocks of 16 positions: the five requests together need more (about 300 positions), so
    # the scheduler budgets the pool in blocks, preempting instead of running it out.
    paged = specrs.Engine(engine.model_path, kv_layout="paged", kv_block_size=16, max_kv_tokens=256)
    assert paged.kv_pool == {"block_size": 16, "num_blocks": 16, "num_free": 16}
    assert engine.kv_pool is None
    params = [_params(i) for i in range(len(PROMPTS))]
    got = paged.generate(PROMPTS, params, speculative_config=NGRAM, progress=False)
    want = engine.generate(PROMPTS, params, speculative_config=NGRAM, progress=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert sum(len(r.prompt_token_ids) + len(r.token_ids) for r in got) > 256
    assert paged.kv_pool["num_free"] == 16


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_paged_pool_on_the_candle_decoder_generates_what_contiguous_does(family):
    # An HF directory runs the candle decoder: its paged pool is a tensor per layer on its device,
    # written and attended for every request's rows at once (model/candle/paged_attention.rs).
    model = Path(__file__).parent / "golden" / "hf" / family
    contiguous = specrs.Engine(str(model))
    paged = specrs.Engine(str(model), kv_layout="paged", kv_block_size=4, max_kv_tokens=96)
    prompts = [[3, 7, 11, 3, 7, 11, 3], [5, 9, 5, 9, 5], [2, 4, 6, 8, 2, 4, 6, 8, 2, 4]]
    params = [specrs.SamplingParams(max_tokens=12 + 3 * i, temperature=0, ignore_eos=True) for i in range(3)]
    tree = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "tree": True, "tree_top_k": 2}
    for config in (None, NGRAM, tree):
        got = paged.generate(prompts, params, speculative_config=config, progress=False)
        want = contiguous.generate(prompts, params, speculative_config=config, progress=False)
        assert [r.token_ids for r in got] == [r.token_ids for r in want], config
        assert paged.kv_pool["num_free"] == 24


def test_the_default_kv_layout_is_paged_on_cuda_and_contiguous_on_the_cpu(engine):
    """kv_layout "auto" (the default), named by Rust for the device: a CPU engine holds no pool, and
    a server on the CPU given --max-kv-tokens budgets it in the scheduler (no pool to size)."""
    from specrs.serve import load_engine

    assert [_specrs.resolve_kv_layout("auto", d) for d in ("cpu", "cuda", "cuda:1")] == ["contiguous", "paged", "paged"]
    assert _specrs.resolve_kv_layout("contiguous", "cuda") == "contiguous"
    assert specrs.Engine(engine.model_path).kv_pool is None
    served = load_engine(engine.model_path, None, "cpu", max_kv_tokens=512)
    assert served._inner.kv_pool is None


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_layout": "pages"}, "'contiguous' or 'paged'"),
    ({"kv_layout": None}, "'contiguous' or 'paged'"),
    ({"kv_layout": "paged", "kv_block_size": 0}, "kv_block_size must be a positive number"),
    ({"kv_layout": "paged", "kv_block_size": 12}, "power of two"),
    ({"kv_layout": "paged", "max_kv_tokens": -1}, "max_kv_tokens must be a positive number"),
    ({"max_kv_tokens": 512}, "contiguous layout"),
])
def test_bad_kv_layout_settings_are_refused_by_name(engine, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        specrs.Engine(engine.model_path, **kwargs)
