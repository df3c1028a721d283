"""The costs behind the adaptive draft length (crates/specrs-core/src/costs.rs): measured when the
engine is built for its method (not inside a request), kept on disk across processes, given in the
config, extended rather than re-measured, never measured once a server turns that off, and always
labelled with where they came from. Also the engine-wide suffix caches' bound."""

import json
import os
import subprocess
import sys

import pytest

import specrs
from specrs import SamplingParams

PROMPT = [{"role": "user", "content": "List the days of the week, then list them again in the same order."}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private cost cache, so these tests measure (and read back) their own figures. Every timing
    counts as quiet, so what the engine measures is stored whatever else the machine is doing (the
    screening of disturbed timings is costs.rs's unit tests')."""
    monkeypatch.setenv("SPECRS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECRS_MAX_QUIET_SPREAD", "1e300")
    return tmp_path


def _prepare_in_new_process(model_path, cache_dir, **env):
    code = ("import json, specrs; e = specrs.Engine(%r, speculative_config=%r); "
            "print(json.dumps(e.prepare(%r)))" % (model_path, NGRAM, NGRAM))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "SPECRS_CACHE_DIR": str(cache_dir), **env})
    return json.loads(out.stdout)


def test_an_engine_measures_its_methods_costs_when_built_and_later_processes_reuse_them(cache_dir, model_path):
    first = _prepare_in_new_process(model_path, cache_dir)
    assert first["verify_cost_source"] == "measured" and first["draft_cost_source"] is None
    files = list((cache_dir / "costs").glob("*.json"))
    assert len(files) == 1, "building the engine measured the curve and stored it"
    stored = json.loads(files[0].read_text())["verify_costs_s"]["512"]
    assert len(stored) >= 3 and stored == sorted(stored) and stored[0] > 0
    # A new process reads the figures instead of measuring them: the same curve, labelled "cached",
    # in its requests' metrics too.
    engine = specrs.Engine(model_path, speculative_config=NGRAM)
    r = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))
    assert r.metrics["verify_cost_source"] == "cached" and r.metrics["draft_cost_source"] is None
    assert engine.prepare(NGRAM)["verify_cost_ratios"] == pytest.approx(first["verify_cost_ratios"], rel=1e-12)
    assert first["verify_cost_ratios"] == pytest.approx([t / stored[0] for t in stored[:3]], rel=1e-12)
    # SPECRS_COST_CACHE=0: measured afresh, nothing read.
    assert _prepare_in_new_process(model_path, cache_dir, SPECRS_COST_CACHE="0")["verify_cost_source"] == "measured"


def test_a_larger_k_extends_the_curve_and_never_changes_what_smaller_ks_read(cache_dir, model_path):
    """The README's reproducibility claim: a later request with a larger k must not change an
    earlier request's draft lengths, so the curve's first points never move."""
    engine = specrs.Engine(model_path)
    # A seeded sampled request, then one with a larger k (measured on demand: the curve grows),
    # then the first again: same tokens, same draft lengths.
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=11)
    config = {**NGRAM, "num_speculative_tokens": 2}
    first = engine.generate(PROMPT, params, speculative_config=config)
    short = engine.verify_cost_ratios(3)
    engine.generate(PROMPT, params, speculative_config={**NGRAM, "num_speculative_tokens": 6})
    longer = engine.verify_cost_ratios(7)
    again = engine.generate(PROMPT, params, speculative_config=config)
    assert again.token_ids == first.token_ids
    assert again.metrics["num_draft_tokens"] == first.metrics["num_draft_tokens"] > 0
    assert longer[:3] == short  # bitwise: extended, not re-measured
    assert engine.prepare(config)["verify_cost_ratios"] == short


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
    """What `specrs serve` does once it serves: a per-request config never measures inside the
    generation loop; the curve is extended and a draft's cost is a prior from its size."""
    engine = specrs.Engine(model_path)
    engine.set_measure_on_demand(False)
    prior = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), speculative_config=NGRAM)
    assert prior.metrics["verify_cost_source"] == "prior"
    assert not list(cache_dir.glob("costs/*.json")), "nothing was measured"
    engine.prepare(NGRAM)  # the server's own config, measured at startup: 3 points
    longer = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), speculative_config={**NGRAM, "num_speculative_tokens": 6})
    assert longer.metrics["verify_cost_source"] == "extrapolated"
    skip = {"method": "layer_skip", "exit_layer": 15, "num_speculative_tokens": 2}
    layer_skip = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), speculative_config=skip)
    assert layer_skip.metrics["draft_cost_source"] == "prior"
    assert engine.verify_cost_ratios(3) == engine.prepare(NGRAM)["verify_cost_ratios"]
    # Measured at startup, then read: a measured draft cost is "measured".
    engine.set_measure_on_demand(True)
    assert engine.prepare(skip)["draft_cost_source"] in ("measured", "disturbed")


def test_suffix_caches_are_bounded_and_the_engines_own_is_kept(model_path):
    default = {"method": "suffix", "num_speculative_tokens": 8}
    engine = specrs.Engine(model_path, speculative_config=default)
    params = SamplingParams(temperature=0, max_tokens=32)
    first = engine.generate(PROMPT, params)
    # Ten other suffix configs, one request each: each gets a cache, the oldest go.
    for depth in range(10, 20):
        engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4),
                        speculative_config={"method": "suffix", "suffix_decoding_max_tree_depth": depth})
    memory = engine.memory()
    assert memory["num_suffix_caches"] == 8
    assert memory["suffix_cache_bytes"] > 0
    # The default's cache survived the churn: the repeat is drafted from its first response.
    again = engine.generate(PROMPT, params)
    assert again.token_ids == first.token_ids
    assert again.metrics["num_accepted_tokens"] > first.metrics["num_accepted_tokens"]
