"""The costs behind the adaptive draft length (crates/specrs-core/src/costs.rs,
engine/cost_worker.rs): an engine starts on the figures its disk cache holds (else the prior),
measures the rest in a background thread while no request runs, never inside a request, keeps
what it measured on disk for later processes, takes the costs a config gives, extends rather than
re-measures, and labels every figure with where it came from. Also the engine-wide suffix caches'
bound."""

import json

import pytest

import specrs
from specrs import SamplingParams

PROMPT = [{"role": "user", "content": "List the days of the week, then list them again in the same order."}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty cost cache, so these tests measure (and read back) their own figures. Every
    timing counts as quiet, so no engine re-measures a figure an earlier one stored whatever else
    the machine is doing (the screening of disturbed timings is costs.rs's unit tests')."""
    monkeypatch.setenv("SPECRS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECRS_MAX_QUIET_SPREAD", "1e300")
    return tmp_path


def test_an_engine_starts_on_the_prior_measures_in_the_background_and_later_engines_read_the_cache(cache_dir,
                                                                                               model_path):
    engine = specrs.Engine(model_path, speculative_config=NGRAM)
    # Built at once: nothing was cached, so its figures are the prior, and the curve is queued.
    first = engine.prepare(NGRAM)
    assert first["verify_cost_source"] == "prior" and first["verify_cost_spread"] is None
    assert first["draft_cost_source"] is None
    status = engine.cost_status()
    assert status["num_foreground_measurements"] == 0
    assert any("verification cost curve" in p for p in status["pending"]), status
    # A request reads what is there now; it never measures.
    r = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))
    assert r.metrics["verify_cost_source"] == "prior"
    assert engine.cost_status()["num_foreground_measurements"] == 0
    # Idle, the background thread measures the curve and stores it with its spread.
    assert engine.wait_for_costs()
    status = engine.cost_status()
    assert status["pending"] == [] and status["num_background_measurements"] >= 1
    assert status["num_foreground_measurements"] == 0 and status["num_failed_measurements"] == 0
    measured = engine.prepare(NGRAM)
    assert measured["verify_cost_source"] == "measured" and measured["verify_cost_spread"]["tries"] >= 5
    assert measured["verify_cost_spread"]["ratio"] >= 1.0
    files = list((cache_dir / "costs").glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())["verify_costs_s"]["512"]
    assert stored["costs_s"] == sorted(stored["costs_s"]) and stored["costs_s"][0] > 0 and stored["tries"] >= 5
    assert measured["verify_cost_ratios"] == pytest.approx([t / stored["costs_s"][0] for t in stored["costs_s"][:3]],
                                                           rel=1e-12)
    # A later engine starts on the cached figures: nothing to measure, the same curve.
    later = specrs.Engine(model_path, speculative_config=NGRAM)
    cached = later.prepare(NGRAM)
    assert cached["verify_cost_source"] == "cached" and later.cost_status()["pending"] == []
    assert cached["verify_cost_ratios"] == pytest.approx(measured["verify_cost_ratios"], rel=1e-12)
    r = later.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))
    assert r.metrics["verify_cost_source"] == "cached"


def test_without_the_disk_cache_every_engine_starts_on_the_prior(cache_dir, model_path, monkeypatch):
    monkeypatch.setenv("SPECRS_COST_CACHE", "0")
    engine = specrs.Engine(model_path, speculative_config=NGRAM)
    assert engine.prepare(NGRAM)["verify_cost_source"] == "prior"
    assert engine.wait_for_costs() and engine.prepare(NGRAM)["verify_cost_source"] == "measured"
    assert not list(cache_dir.glob("costs/*.json")), "nothing was stored"


def test_the_background_thread_measures_only_while_no_request_is_in_flight(cache_dir, model_path):
    """A request in flight (a stream not yet finished holds its KV cache) keeps the measurement
    from completing, however long it waits; once it ends, the measurement lands."""
    engine = specrs.Engine(model_path)
    stream = engine.stream(PROMPT, SamplingParams(temperature=0, max_tokens=8), speculative_config=NGRAM)  # queues the curve
    assert engine.cost_status()["pending"]
    assert not engine.wait_for_costs(timeout_s=1.0)
    assert engine.cost_status()["num_background_measurements"] == 0
    assert "".join(stream)  # the request runs to its end
    assert stream.result.metrics["verify_cost_source"] == "prior"
    assert engine.wait_for_costs() and engine.cost_status()["num_background_measurements"] >= 1
    with pytest.raises(specrs.ConfigError, match="timeout_s"):
        engine.wait_for_costs(timeout_s=-1)


def test_a_larger_k_extends_the_curve_and_never_changes_what_smaller_ks_read(cache_dir, model_path):
    """The README's reproducibility claim: once the figures are measured, a later request with a
    larger k must not change an earlier request's draft lengths, so the curve's first points never
    move."""
    engine = specrs.Engine(model_path)
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=11)
    config = {**NGRAM, "num_speculative_tokens": 2}
    engine.prepare(config)
    assert engine.wait_for_costs()
    # A seeded sampled request, then one with a larger k (its curve grows in the background), then
    # the first again: same tokens, same draft lengths.
    first = engine.generate(PROMPT, params, speculative_config=config)
    short = engine.verify_cost_ratios(3)
    engine.generate(PROMPT, params, speculative_config={**NGRAM, "num_speculative_tokens": 6})
    assert engine.wait_for_costs()
    longer = engine.verify_cost_ratios(7)
    again = engine.generate(PROMPT, params, speculative_config=config)
    assert again.token_ids == first.token_ids
    assert again.metrics["num_draft_tokens"] == first.metrics["num_draft_tokens"] > 0
    assert longer[:3] == short  # bitwise: extended, not re-measured
    assert engine.prepare(config)["verify_cost_ratios"] == short
    # Every figure came from the background thread: the curves asked for were already there.
    assert engine.cost_status()["num_foreground_measurements"] == 0
    # A curve at another context length is measured when a program asks for it, in its thread.
    assert len(engine.verify_cost_ratios(2, context_len=64)) == 2
    assert engine.cost_status()["num_foreground_measurements"] == 1


def test_costs_given_in_the_config_are_used_as_they_are(engine):
    ratios = [1.0, 1.3, 1.5]
    costs = engine.prepare({**NGRAM, "verify_cost_ratios": ratios})
    assert costs["verify_cost_ratios"] == ratios and costs["verify_cost_source"] == "config"
    # A k past the given curve extends its last slope, and says so.
    costs = engine.prepare({**NGRAM, "num_speculative_tokens": 4, "verify_cost_ratios": ratios})
    assert costs["verify_cost_ratios"] == pytest.approx([1.0, 1.3, 1.5, 1.7, 1.9])
    assert costs["verify_cost_source"] == "extrapolated"
    with pytest.raises(specrs.ConfigError, match="v\\(1\\) must be 1"):
        engine.prepare({**NGRAM, "verify_cost_ratios": [2.0, 3.0]})


def test_without_measuring_on_demand_a_request_gets_the_nearest_figures(cache_dir, model_path):
    """Measuring off: nothing is queued; a per-request config gets the curve extended past its end
    and a draft's cost is a prior from its size."""
    engine = specrs.Engine(model_path)
    engine.set_measure_on_demand(False)
    prior = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), speculative_config=NGRAM)
    assert prior.metrics["verify_cost_source"] == "prior"
    assert engine.cost_status()["pending"] == []
    assert not list(cache_dir.glob("costs/*.json")), "nothing was measured"
    engine.set_measure_on_demand(True)
    engine.prepare(NGRAM)  # 3 points, measured in the background
    assert engine.wait_for_costs()
    engine.set_measure_on_demand(False)
    longer = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), speculative_config={**NGRAM, "num_speculative_tokens": 6})
    assert longer.metrics["verify_cost_source"] == "extrapolated"
    skip = {"method": "layer_skip", "exit_layer": 15, "num_speculative_tokens": 2}
    layer_skip = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), speculative_config=skip)
    assert layer_skip.metrics["draft_cost_source"] == "prior"
    assert engine.cost_status()["pending"] == []
    # Measuring on: the draft's cost is measured in the background, then read.
    engine.set_measure_on_demand(True)
    assert engine.prepare(skip)["draft_cost_source"] == "prior"
    assert engine.wait_for_costs()
    costs = engine.prepare(skip)
    assert costs["draft_cost_source"] == "measured" and costs["draft_cost"] > 0
    assert costs["draft_cost_spread"]["tries"] >= 1


def test_suffix_caches_are_bounded_and_the_engines_own_is_kept(model_path):
    # The verification curve pinned, as the accepted counts compared below follow the draft
    # lengths a measured curve (how busy the machine is) would choose.
    ratios = [1.0 + 0.05 * n for n in range(9)]
    default = {"method": "suffix", "num_speculative_tokens": 8, "verify_cost_ratios": ratios}
    engine = specrs.Engine(model_path, speculative_config=default)
    params = SamplingParams(temperature=0, max_tokens=32)
    first = engine.generate(PROMPT, params)
    # Ten other suffix configs, one request each: each gets a cache, the oldest go.
    for depth in range(10, 20):
        engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4),
                        speculative_config={"method": "suffix", "suffix_decoding_max_tree_depth": depth,
                                            "verify_cost_ratios": ratios})
    memory = engine.memory()
    assert memory["num_suffix_caches"] == 8
    assert memory["suffix_cache_bytes"] > 0
    # The default's cache survived the churn: the repeat is drafted from its first response.
    again = engine.generate(PROMPT, params)
    assert again.token_ids == first.token_ids
    assert again.metrics["num_accepted_tokens"] > first.metrics["num_accepted_tokens"]
