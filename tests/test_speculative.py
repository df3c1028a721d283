"""Speculative decoding on the real default model: losslessness (greedy identity for every
method and k, sampled distribution), custom proposers, configs, metrics."""

import json
import random
from collections import Counter

import numpy as np
import pytest

import specrs
from specrs import SamplingParams

# A Spec-Bench-like mix (one prompt per category), written for these tests.
PROMPTS = {
    "summarization": "Summarize in two sentences: The city council met on Tuesday to discuss the new bike "
    "lanes. The council approved the bike lanes on Main Street and Oak Avenue. Construction of the "
    "bike lanes will start in May and the bike lanes should be finished by September.",
    "rag": "Context: The Amazon river is about 6400 km long. The Amazon river flows through Peru, "
    "Colombia and Brazil. The Amazon river carries more water than any other river.\n"
    "Question: Which countries does the Amazon river flow through?",
    "qa": "What is the capital of France, and what river runs through it?",
    "translation": "Translate to French: The cat is sleeping on the red chair in the kitchen.",
    "math_reasoning": "A shop sells pencils at 3 for 2 dollars. How much do 12 pencils cost? Explain.",
    "coding": "Write a Python function that returns the sum of the squares of a list of numbers.",
    "extraction": "List every number in this text: In 2020 we sold 150 cars, 45 trucks and 7 buses.",
    "writing": "Write a short poem about the sea at night.",
    "roleplay": "You are a pirate captain. Greet your new crew in three sentences.",
    "reasoning": "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Why?",
    "stem": "Explain why the sky is blue in simple words.",
    "humanities": "Who was Leonardo da Vinci? Answer briefly.",
}
MAX_TOKENS = 40
KS = [1, 2, 4, 8]


def chat(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def baselines(engine):
    """Plain greedy decoding of every prompt: prompt ids -> generated ids."""
    out = {}
    for name, text in PROMPTS.items():
        r = engine.generate(chat(text), SamplingParams(temperature=0, max_tokens=MAX_TOKENS), speculative_config=False)
        assert r.metrics["num_drafts"] == 0 and r.metrics["spec_method"] is None
        out[name] = (r.prompt_token_ids, r.token_ids)
    return out


class NoisyOracle:
    """Proposes the known greedy continuation with some tokens swapped for wrong ones, so every
    acceptance length and rejection position gets exercised."""

    def __init__(self, prompt_len, expected, vocab_size, seed):
        self.prompt_len = prompt_len
        self.expected = expected
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.accepted = []

    def propose(self, context_ids, max_tokens):
        start = len(context_ids) - self.prompt_len
        draft = list(self.expected[start : start + max_tokens])
        for i in range(len(draft)):
            if self.rng.random() < 0.2:
                draft[i] = self.rng.randrange(self.vocab_size)
        return draft

    def observe(self, num_accepted):
        self.accepted.append(num_accepted)


# Fixed draft length, so every draft position 1..k gets verified.
SPEC_CONFIGS = {
    "ngram": lambda k: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": lambda k: {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_min_token_prob": 0.0},
    "custom": lambda k: {"method": "custom", "num_speculative_tokens": k},
}


@pytest.mark.parametrize("method", list(SPEC_CONFIGS))
@pytest.mark.parametrize("k, adaptive", [(k, False) for k in KS] + [(8, True)])
def test_greedy_identity(engine, baselines, method, k, adaptive):
    drafted = accepted = 0
    accepted_per_pos = [0] * k
    for seed, (name, (prompt_ids, expected)) in enumerate(baselines.items()):
        proposer = None
        if method == "custom":
            proposer = NoisyOracle(len(prompt_ids), expected, engine.tokenizer.vocab_size, seed)
        r = engine.generate(
            prompt_ids,
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
            speculative_config={**SPEC_CONFIGS[method](k), "adaptive_draft_length": adaptive},
            proposer=proposer,
        )
        assert r.token_ids == expected, f"{method} k={k} diverged from plain greedy on {name!r}"
        m = r.metrics
        assert m["spec_method"] == method and m["num_speculative_tokens"] == k
        assert len(m["num_accepted_tokens_per_pos"]) == k
        assert sum(m["num_accepted_tokens_per_pos"]) == m["num_accepted_tokens"] <= m["num_draft_tokens"]
        assert m["num_draft_tokens"] <= k * m["num_drafts"]
        # Every step yields accepted + 1 tokens, so forwards = prefill + steps.
        assert m["num_forward_passes"] == 1 + m["num_decode_steps"]
        # Tokens after an end-of-sequence token inside a draft are accepted but not emitted.
        emitted = m["num_decode_steps"] + m["num_accepted_tokens"]
        assert emitted == len(r.token_ids) - 1 if r.finish_reason == "length" else emitted >= len(r.token_ids) - 1
        if proposer is not None:
            assert sum(proposer.accepted) == m["num_accepted_tokens"]
        drafted += m["num_draft_tokens"]
        accepted += m["num_accepted_tokens"]
        accepted_per_pos = [a + b for a, b in zip(accepted_per_pos, m["num_accepted_tokens_per_pos"])]
    # The proposers must actually speculate on this mix, or the identity above proves little.
    assert drafted > 0 and accepted > 0, f"{method} k={k}: no draft token was ever accepted"
    if method == "custom" and not adaptive:
        # The oracle drafts whole continuations: even the last position gets verified and kept.
        assert accepted_per_pos[-1] > 0, accepted_per_pos


class TargetGuess:
    """A draft-model-like custom proposer built from the target's own logits (cached per
    context, since the sampled contexts repeat across seeds). With `sharpen`, it samples the draft
    token from a sharpened target distribution and returns those draft probabilities; without,
    it drafts the target's argmax deterministically (one-hot q)."""

    cache: dict = {}

    def __init__(self, engine, seed, sharpen):
        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.sharpen = sharpen
        self.num_drafts = 0

    def propose(self, context_ids, max_tokens):
        key = tuple(context_ids)
        if key not in self.cache:
            self.cache[key] = self.engine.logits(context_ids)[-1].astype(np.float64)
        logits = self.cache[key]
        self.num_drafts += 1
        if not self.sharpen:
            return [int(logits.argmax())]
        q = np.exp((logits - logits.max()) / 0.7)
        q /= q.sum()
        token = int(self.rng.choice(len(q), p=q))
        return [token], q[None, :].astype(np.float32)


def two_sample_chi_square(a: Counter, b: Counter):
    cells = set(a) | set(b)
    na, nb = sum(a.values()), sum(b.values())
    statistic = 0.0
    for c in cells:
        total = a[c] + b[c]
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        statistic += (a[c] - ea) ** 2 / ea + (b[c] - eb) ** 2 / eb
    return statistic, len(cells) - 1


def assert_same_distribution(plain: Counter, speculative: Counter):
    """Two-sample chi-square at p = 0.001, rare cells merged so every expected count is large
    enough for the approximation."""
    rare = {c for c in set(plain) | set(speculative) if plain[c] + speculative[c] < 10}

    def merge(h: Counter) -> Counter:
        merged = Counter()
        for c, v in h.items():
            merged[c if c not in rare else "rare"] += v  # every rare cell adds to one bucket
        return merged

    plain, speculative = merge(plain), merge(speculative)
    statistic, df = two_sample_chi_square(plain, speculative)
    assert df >= 4, f"too few distinct outcomes to test: {plain}"
    assert statistic < chi_square_critical(df), f"chi2 {statistic:.1f} (df {df}): {plain} vs {speculative}"


def chi_square_critical(df):
    """Critical value at p = 0.001 (Wilson-Hilferty)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("with_probs", [False, True])
def test_sampling_with_speculation_matches_plain_sampling(engine, with_probs):
    """The 2nd and 3rd generated tokens (the first ones speculation decides) have the same joint
    distribution with and without speculation, over many seeds."""
    prompt = engine.tokenizer.encode("My favorite color is")
    params = lambda seed: SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=seed)  # noqa: E731
    config = {"method": "custom", "num_speculative_tokens": 1}
    n = 400
    plain, speculative, num_drafts = sample_with_and_without(
        engine, prompt, params, n,
        lambda seed: {"speculative_config": config, "proposer": TargetGuess(engine, seed, sharpen=with_probs)},
    )
    assert num_drafts >= n  # speculation decided the second token of every request
    assert_same_distribution(plain, speculative)


def sample_with_and_without(engine, prompt, params, n, speculation):
    """The tokens after the first of n plain requests (seeds 0..n-1) and of n speculative ones
    (seeds 10000..), as Counters, and the speculative requests' drafts summed. `speculation(seed)`
    gives generate()'s speculation arguments for one request."""
    plain, speculative = Counter(), Counter()
    num_drafts = 0
    for seed in range(n):
        plain[tuple(engine.generate(prompt, params(seed), speculative_config=False).token_ids[1:])] += 1
        r = engine.generate(prompt, params(10_000 + seed), **speculation(seed))
        speculative[tuple(r.token_ids[1:])] += 1
        num_drafts += r.metrics["num_drafts"]
    return plain, speculative, num_drafts


def test_sampled_speculation_is_seeded(engine):
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    run = lambda seed: engine.generate(  # noqa: E731
        chat(PROMPTS["summarization"]),
        SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=seed),
        speculative_config=config,
    ).token_ids
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_engine_default_override_and_off(model_path):
    engine = specrs.Engine(model_path, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert engine.speculative_config["prompt_lookup_min"] == 5  # vLLM's default filled in
    text = chat(PROMPTS["rag"])
    params = SamplingParams(temperature=0, max_tokens=24)
    assert engine.generate(text, params).metrics["spec_method"] == "ngram"
    assert engine.generate(text, params, speculative_config=False).metrics["spec_method"] is None
    r = engine.generate(text, params, speculative_config={"method": "suffix"})
    assert r.metrics["spec_method"] == "suffix" and r.metrics["num_speculative_tokens"] == 24


def test_stream_with_speculation_yields_the_same_text(engine):
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    text = chat(PROMPTS["extraction"])
    whole = engine.generate(text, SamplingParams(temperature=0, max_tokens=40), speculative_config=config)
    stream = engine.stream(text, SamplingParams(temperature=0, max_tokens=40), speculative_config=config)
    chunks = list(stream)
    assert "".join(chunks) == whole.text
    assert stream.result.token_ids == whole.token_ids
    assert stream.result.metrics["num_drafts"] > 0


def test_engine_metrics_sum_requests_and_report_expected_speedup(model_path):
    engine = specrs.Engine(model_path, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    results = [engine.generate(chat(PROMPTS[n]), SamplingParams(temperature=0, max_tokens=24)) for n in ("rag", "extraction")]
    assert engine.wait_for_costs()  # the curve the expected speedup reads, measured in the background
    m = engine.metrics()
    assert m["num_requests"] == 2
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert m[key] == sum(r.metrics[key] for r in results)
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    assert m["acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])
    assert m["itl_s_p50"] <= m["itl_s_p99"] and m["decode_tokens_per_s"] > 0
    assert m["expected_speedup_textbook"] > 0 and m["expected_speedup_refined"] > 0
    # Verifying k+1 tokens never costs less than one step (the curve is non-decreasing), so the
    # refined prediction is never above the textbook one. (How much more it costs is the machine's.)
    assert m["verify_cost_ratio"] >= 1 and m["expected_speedup_refined"] <= m["expected_speedup_textbook"]
    assert m["verify_cost_source"] in ("measured", "cached")
    engine.reset_metrics()
    assert engine.metrics()["num_requests"] == 0


def test_expected_speedup_formulas():
    assert specrs.expected_speedup(0.0, 4) == pytest.approx(1.0)
    assert specrs.expected_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.25)
    assert specrs.expected_speedup(0.5, 2, 0.0, verify_cost_ratio=1.4) == pytest.approx(1.75 / 1.4)
    # A measured curve [v(1), v(2), v(3)] is read at k + 1, interpolated for a fractional k.
    curve = [1.0, 1.3, 1.4]
    assert specrs.expected_speedup(0.5, 2, verify_cost_ratio=curve) == pytest.approx(1.75 / 1.4)
    assert specrs.expected_speedup(0.0, 1.5, verify_cost_ratio=curve) == pytest.approx(1 / 1.35)
    with pytest.raises(specrs.ConfigError):
        specrs.expected_speedup(1.5, 2)


def test_suffix_decoding_learns_from_previous_responses(model_path):
    # The verification curve pinned: the counts compared below follow the draft lengths, which
    # follow a measured curve, i.e. how busy the machine is.
    engine = specrs.Engine(model_path, speculative_config={"method": "suffix", "num_speculative_tokens": 8,
                                                           "verify_cost_ratios": [1.0 + 0.05 * n for n in range(9)]})
    text = chat(PROMPTS["writing"])
    first = engine.generate(text, SamplingParams(temperature=0, max_tokens=48))
    second = engine.generate(text, SamplingParams(temperature=0, max_tokens=48))
    assert second.token_ids == first.token_ids
    # The global tree holds the first response, so the repeat is drafted almost entirely.
    assert second.metrics["num_accepted_tokens"] > first.metrics["num_accepted_tokens"]
    assert second.metrics["num_forward_passes"] < first.metrics["num_forward_passes"]


class AlwaysWrong:
    def __init__(self):
        self.calls = 0

    def propose(self, context_ids, max_tokens):
        self.calls += 1
        return [(context_ids[-1] + 1) % 1000] * max_tokens  # never what the model says


def test_adaptive_draft_length_backs_off_when_drafts_fail(engine):
    prompt = chat(PROMPTS["qa"])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # The verify cost SmolLM2 measures on 2 cores, pinned: the policy is tested, not the machine
    # (a measured curve moves with the machine's load, and the back-off with it).
    config = {"method": "custom", "num_speculative_tokens": 4, "verify_cost_ratios": [1.0, 1.4, 1.6, 2.0, 2.4]}
    fixed_config = {"method": "custom", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    fixed = engine.generate(prompt, params, speculative_config=fixed_config, proposer=AlwaysWrong())
    adaptive = engine.generate(prompt, params, speculative_config=config, proposer=AlwaysWrong())
    assert adaptive.token_ids == fixed.token_ids
    # Fixed: every step drafts min(k, tokens left - 1), so the last steps never overshoot max_tokens.
    assert fixed.metrics["num_draft_tokens"] == sum(min(4, 40 - generated - 1) for generated in range(1, 40))
    # Only occasional one-token probes once the failures are measured.
    assert adaptive.metrics["num_draft_tokens"] <= fixed.metrics["num_draft_tokens"] / 10, adaptive.metrics
    assert adaptive.metrics["verify_cost_source"] == "config" and adaptive.metrics["draft_cost_source"] is None


class Raising:
    def propose(self, context_ids, max_tokens):
        raise RuntimeError("boom")


class OutOfVocab:
    def propose(self, context_ids, max_tokens):
        return [10**9]


class BadProbs:
    def propose(self, context_ids, max_tokens):
        return [1], np.ones((1, 3), dtype=np.float32)


class TooMany:
    def propose(self, context_ids, max_tokens):
        return [1] * (max_tokens + 1)


@pytest.mark.parametrize(
    "proposer, message",
    [
        (Raising(), "raised RuntimeError: boom"),
        (OutOfVocab(), "outside the vocabulary"),
        (BadProbs(), "draft probabilities"),
        (TooMany(), "at most"),
    ],
)
def test_bad_custom_proposers_raise_proposer_error(engine, proposer, message):
    with pytest.raises(specrs.ProposerError, match=message):
        engine.generate("Hello", SamplingParams(temperature=0, max_tokens=8), proposer=proposer)


def test_proposer_with_a_builtin_method_is_refused_not_ignored(engine):
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(specrs.ConfigError, match="use \"method\": \"custom\""):
        engine.generate("Hello", SamplingParams(temperature=0, max_tokens=4), speculative_config=ngram,
                        proposer=TooMany())
    with pytest.raises(specrs.ConfigError, match="speculative_config=False"):
        engine.generate("Hello", SamplingParams(temperature=0, max_tokens=4), speculative_config=False,
                        proposer=TooMany())


def test_proposer_without_propose_is_a_config_error(engine):
    with pytest.raises(specrs.ConfigError, match="propose"):
        engine.generate("Hello", SamplingParams(temperature=0, max_tokens=4), proposer=object())


@pytest.mark.parametrize(
    "config, fix",
    [
        ({"method": "ngram", "num_spec_tokens": 4}, "did you mean 'num_speculative_tokens'"),
        ({"method": "ngarm", "num_speculative_tokens": 4}, "did you mean 'ngram'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in 1..="),
        ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "must be <="),
        ({"method": "custom", "num_speculative_tokens": 4}, "needs a proposer object"),
        ("{not json", "not valid JSON"),
        (["ngram"], "dict or a JSON string"),
    ],
)
def test_bad_speculative_config_names_the_fix(engine, config, fix):
    with pytest.raises(specrs.ConfigError, match=fix):
        engine.generate("Hello", SamplingParams(temperature=0, max_tokens=4), speculative_config=config)


def test_bad_engine_config_fails_at_construction(model_path):
    with pytest.raises(specrs.ConfigError, match="did you mean 'suffix_decoding_max_tree_depth'"):
        specrs.Engine(model_path, speculative_config=json.dumps({"method": "suffix", "suffix_decoding_max_depth": 3}))
