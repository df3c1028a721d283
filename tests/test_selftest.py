"""`specrs selftest`: its statistics against closed forms, its checks catching broken speculation
(a proposer that misreports its draft probabilities, drafts that depend on earlier requests, a
changed token), and the command itself on the default model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import specrs
from specrs import selftest


# --- statistics ------------------------------------------------------------------------------


def chi_square_sf_even_df(x: float, df: int) -> float:
    """Closed form for even df: exp(-x/2) * sum_{i < df/2} (x/2)^i / i!."""
    term, total = 1.0, 1.0
    for i in range(1, df // 2):
        term *= (x / 2) / i
        total += term
    return math.exp(-x / 2) * total


@pytest.mark.parametrize("x", [0.01, 0.5, 1.0, 2.5, 3.84, 7.0, 15.0, 40.0, 90.0])
def test_chi_square_sf_matches_closed_forms(x):
    assert selftest.chi_square_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10, abs=1e-300)
    assert selftest.chi_square_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
    # df = 3: erfc(sqrt(x/2)) + sqrt(2x/pi) exp(-x/2).
    df3 = math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2)
    assert selftest.chi_square_sf(x, 3) == pytest.approx(df3, rel=1e-9)
    for df in (4, 10, 50):
        assert selftest.chi_square_sf(x, df) == pytest.approx(chi_square_sf_even_df(x, df), rel=1e-9, abs=1e-300)


def test_chi_square_sf_known_values():
    # Table values: the 5% and 0.1% critical points.
    assert selftest.chi_square_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert selftest.chi_square_sf(10.827566170662733, 1) == pytest.approx(0.001, rel=1e-8)
    assert selftest.chi_square_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)
    assert selftest.chi_square_sf(200.0, 200) == pytest.approx(chi_square_sf_even_df(200.0, 200), rel=1e-9)
    assert selftest.chi_square_sf(0.0, 5) == 1.0
    assert selftest.chi_square_sf(1e6, 5) == 0.0
    with pytest.raises(ValueError, match="df >= 1"):
        selftest.chi_square_sf(1.0, 0)
    with pytest.raises(ValueError, match="a > 0"):
        selftest.regularized_gamma_q(0.0, 1.0)


def test_two_sample_chi_square_tells_same_from_different():
    same = selftest.two_sample_chi_square(Counter({"a": 120, "b": 60, "c": 20}), Counter({"a": 120, "b": 60, "c": 20}))
    assert (same["statistic"], same["df"], same["p_value"]) == (0.0, 2, 1.0)
    # The draft token accepted every time (100%) where the target gives it 60%.
    broken = selftest.two_sample_chi_square(Counter({"a": 120, "b": 80}), Counter({"a": 200}))
    assert broken["df"] == 1 and broken["p_value"] < 1e-20
    # Two samples from one distribution: a large p-value.
    rng = np.random.default_rng(0)
    draws = rng.choice(4, p=[0.5, 0.3, 0.15, 0.05], size=(2, 400))
    fair = selftest.two_sample_chi_square(Counter(draws[0].tolist()), Counter(draws[1].tolist()))
    assert fair["df"] == 3 and fair["p_value"] > 0.01


def test_rare_outcomes_are_pooled_until_each_cell_is_large_enough():
    a = Counter({"x": 50, "y": 30, "r1": 3, "r2": 2})
    b = Counter({"x": 45, "y": 35, "r3": 4, "r1": 1})
    pa, pb = selftest.pool_rare_outcomes(a, b)
    # r1 (4), r2 (2) and r3 (4) are each under 10 in both samples together: one "other" cell of 10.
    assert (pa, pb) == (Counter({"x": 50, "y": 30, "other": 5}), Counter({"x": 45, "y": 35, "other": 5}))
    # A pooled cell still under 10 takes the next rarest outcome in.
    pa, pb = selftest.pool_rare_outcomes(Counter({"x": 50, "y": 12, "r": 2}), Counter({"x": 50, "y": 10, "r": 1}))
    assert set(pa) | set(pb) == {"x", "other"} and pa["other"] + pb["other"] == 25
    result = selftest.two_sample_chi_square(Counter({"x": 5}), Counter({"x": 5}))
    assert result["df"] == 0 and result["p_value"] == 1.0


def test_first_difference():
    assert selftest.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert selftest.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert selftest.first_difference([1, 2, 3], [1, 2]) == 2  # a shorter output differs where it ends
    assert selftest.first_difference([], [7]) == 0


# --- checks catching broken speculation ------------------------------------------------------


def lookup(context_ids, max_tokens):
    """Prompt lookup on the last token: what followed its most recent earlier occurrence."""
    last = context_ids[-1]
    for i in range(len(context_ids) - 2, -1, -1):
        if context_ids[i] == last:
            return list(context_ids[i + 1 : i + 1 + max_tokens])
    return []


class MisreportingProposer:
    """Drafts by prompt lookup (deterministically, so the honest q is one-hot) but reports a draft
    probability of 0.001 for each drafted token: rejection sampling then accepts the draft
    whenever the target gives it at least 0.001, and the output is no longer the target's
    distribution. Greedy verification ignores q, so greedy output stays exact."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def propose(self, context_ids, max_tokens):
        draft = lookup(context_ids, max_tokens)
        probs = np.zeros((len(draft), self.vocab_size), dtype=np.float32)
        for row, token in enumerate(draft):
            probs[row, token] = 0.001
            probs[row, (token + 1) % self.vocab_size] = 0.999
        return draft, probs


class RememberingProposer:
    """Drafts what followed the current context in an earlier request it saw, as suffix decoding's
    cache does, with draft probabilities (half on the drafted token): a repeated request gets other
    drafts than its first run, and since drafts with probabilities are verified by sequential
    rejection sampling (one-hot ones are coupled and would keep the sample), at a temperature
    above 0 another sample."""

    def __init__(self, vocab_size: int = 49152):
        self.seen = []
        self.vocab_size = vocab_size

    def propose(self, context_ids, max_tokens):
        context = list(context_ids)
        draft = next((s[len(context) : len(context) + max_tokens] for s in reversed(self.seen)
                      if len(s) > len(context) and s[: len(context)] == context), [])
        self.seen = [s for s in self.seen if s != context[: len(s)]] + [context]
        probs = np.full((len(draft), self.vocab_size), 0.5 / (self.vocab_size - 1), dtype=np.float32)
        probs[np.arange(len(draft)), draft] = 0.5
        return draft, probs


def test_misreported_draft_probabilities_fail_the_distribution_check(model_path):
    engine = specrs.Engine(model_path, proposer=MisreportingProposer(49152))
    assert engine.tokenizer.vocab_size == 49152
    report = selftest.run(engine, [{"method": "custom", "num_speculative_tokens": 3}], num_seeds=80, max_tokens=16)
    by_check = {}
    for c in report["checks"]:
        by_check.setdefault(c["check"], []).append(c)
    # Greedy verification does not read q, so greedy output is still exactly plain greedy output...
    greedy = by_check["greedy identity"]
    assert [c["label"] for c in greedy] == [f"custom k={k} (fixed)" for k in (1, 2, 3, 4, 8)] + ["custom k=3 (as given)"]
    assert all(c["status"] == "PASS" and c["num_drafts"] > 0 for c in greedy), [c["detail"] for c in greedy]
    # ...but the sampled tokens are not the target's: the draft is accepted nearly every time.
    (distribution,) = by_check["sampling distribution"]
    assert distribution["status"] == "FAIL", distribution["detail"]
    assert distribution["p_value"] < report["alpha"] and distribution["num_drafts"] > 0
    assert distribution["acceptance_rate"] > 0.95
    assert all(c["status"] == "PASS" for c in by_check["seeded determinism"])
    assert report["passed"] is False and selftest.exit_status(report) == 1
    text = selftest.format_report(report)
    assert "FAIL  sampling distribution  custom k=3 (fixed)" in text
    assert text.splitlines()[-1].startswith("selftest FAIL:")


def test_drafts_that_depend_on_earlier_requests_fail_the_determinism_check(engine, model_path):
    prompts = {name: engine.prompt_token_ids(text) for name, text in selftest.PROMPTS.items()}
    config = {"method": "custom", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    check = selftest.check_determinism(specrs.Engine(model_path, proposer=RememberingProposer()), config,
                                       prompts, max_tokens=32, temperature=1.0, new_engine=None)
    assert check["status"] == "FAIL" and check["differing"], check["detail"]
    assert check["num_drafts"] > 0 and not check["fresh_engine_per_run"]
    plain = selftest.check_determinism(engine, None, prompts, max_tokens=32, temperature=1.0, new_engine=None)
    assert plain["status"] == "PASS" and plain["requests_identical"] == plain["num_requests"] == 4
    assert plain["distinct_samples"] == 4  # different seeds, different samples


class OneTokenChanged:
    """The engine with a broken verifier simulated: speculative output has its last token changed."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt, params, speculative_config=None):
        result = self.engine.generate(prompt, params, speculative_config=speculative_config)
        if speculative_config is not False:
            result.token_ids[-1] = (result.token_ids[-1] + 1) % self.engine.tokenizer.vocab_size
        return result


def test_a_changed_token_fails_the_greedy_check(engine):
    prompts = {name: engine.prompt_token_ids(text) for name, text in selftest.PROMPTS.items()}
    params = specrs.SamplingParams(max_tokens=12, temperature=0.0)
    baselines = {n: engine.generate(ids, params, speculative_config=False).token_ids for n, ids in prompts.items()}
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive_draft_length": False}
    good = selftest.check_greedy_identity(engine, config, True, prompts, baselines, 12)
    assert good["status"] == "PASS" and good["prompts_identical"] == 4 and good["num_drafts"] > 0
    bad = selftest.check_greedy_identity(OneTokenChanged(engine), config, True, prompts, baselines, 12)
    assert bad["status"] == "FAIL" and bad["prompts_identical"] == 0
    assert [m["position"] for m in bad["mismatches"]] == [11] * 4
    assert "'list' at token 11" in bad["detail"]
    # A fixed-length check where nothing drafted proves nothing.
    never = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "adaptive_draft_length": False}
    unique = {"unique": engine.prompt_token_ids("Name one colour.")}
    base = {"unique": engine.generate(unique["unique"], specrs.SamplingParams(temperature=0, max_tokens=3), speculative_config=False).token_ids}
    idle = selftest.check_greedy_identity(engine, never, True, unique, base, 3)
    assert idle["num_drafts"] == 0 and idle["status"] == "FAIL" and "proves nothing" in idle["detail"]


def test_greedy_variants_cover_each_k_and_the_config_as_given():
    variants = selftest.greedy_variants({"method": "ngram", "num_speculative_tokens": 6})
    assert [(c["num_speculative_tokens"], c.get("adaptive_draft_length"), fixed) for c, fixed in variants] == [
        (1, False, True), (2, False, True), (4, False, True), (6, False, True), (8, False, True), (6, None, False)]
    # Already a fixed length at its own k: not run twice. Suffix never drafts past its tree depth.
    variants = selftest.greedy_variants({"method": "suffix", "num_speculative_tokens": 2, "adaptive_draft_length": False,
                                         "suffix_decoding_max_tree_depth": 3})
    assert [c["num_speculative_tokens"] for c, _ in variants] == [1, 2]


def test_bad_configs_name_the_fix():
    with pytest.raises(specrs.ConfigError, match="not valid JSON"):
        selftest.parse_configs(["{method: ngram}"])
    with pytest.raises(specrs.ConfigError, match="ngram"):
        selftest.parse_configs(['{"method": "ngramm", "num_speculative_tokens": 4}'])
    with pytest.raises(specrs.ConfigError, match="Python proposer"):
        selftest.parse_configs([{"method": "custom", "num_speculative_tokens": 4}])
    assert selftest.parse_configs(None) == [dict(c) for c in selftest.DEFAULT_CONFIGS]


# --- the command ---------------------------------------------------------------------------------


def selftest_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "specrs.cli", "selftest", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_selftest_command_passes_on_the_default_model():
    run = selftest_cli("--quick", "--json", "--no-progress")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["passed"] is True and report["counts"]["FAIL"] == 0
    assert report["model"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (report["num_seeds"], report["max_tokens"], report["alpha"]) == (80, 24, 0.001)
    assert [c["method"] for c in report["configs"]] == ["ngram", "suffix"]
    checks = report["checks"]
    assert all(set(c) >= {"check", "label", "status", "detail", "config"} for c in checks)
    greedy = [c for c in checks if c["check"] == "greedy identity"]
    # k = 1, 2, 4, 8 fixed and the config as given (adaptive), for each of the two methods.
    assert len(greedy) == 10 and all(c["status"] == "PASS" and c["num_drafts"] > 0 for c in greedy)
    distribution = [c for c in checks if c["check"] == "sampling distribution"]
    assert len(distribution) == 2
    for c in distribution:
        assert c["status"] == "PASS" and c["alpha"] <= c["p_value"] <= 1 and c["df"] >= 1
        assert c["requests_drafted"] > 0.5 * c["num_seeds"]
        assert sum(cell["without"] for cell in c["cells"]) == sum(cell["with"] for cell in c["cells"]) == 80
    determinism = [c for c in checks if c["check"] == "seeded determinism"]
    assert [c["label"] for c in determinism] == ["no speculation", "ngram k=4 min=2 max=4 (as given)", "suffix k=4 (fixed)"]
    assert all(c["status"] == "PASS" and c["requests_identical"] == c["num_requests"] for c in determinism)
    assert [c["fresh_engine_per_run"] for c in determinism] == [False, False, True]


def test_selftest_command_refuses_bad_input_before_loading():
    run = selftest_cli("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_mn": 2}')
    assert run.returncode == 2 and "prompt_lookup_min" in run.stderr, run.stderr
    run = selftest_cli("--speculative-config", '{"method": "custom", "num_speculative_tokens": 4}')
    assert run.returncode == 2 and "Python proposer" in run.stderr, run.stderr
    run = selftest_cli("no-such-model.gguf", "--quick")
    assert run.returncode == 2 and "no-such-model.gguf" in run.stderr, run.stderr
