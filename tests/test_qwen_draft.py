"""The classic method on real weights: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (same
tokenizer; `make test` installs both with `specrs models install`), alone and inside "auto", which
picks suffix, n-gram or the draft model per step. Greedy identity, the sampled distribution, the
per-drafter counts, and the draft named by its model name."""

import json
from collections import Counter

import pytest
from test_speculative import assert_same_distribution

import specrs
from specrs import SamplingParams

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Explain what a Python list comprehension is, with one example.",
]
# Costs pinned so the drafts do not depend on this machine's timing: a cheap draft (c = 0.1)
# and a flat verification curve, so the model drafts whenever its acceptance allows.
PINNED = {"verify_cost_ratios": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8], "draft_cost": 0.1}
CONFIGS = {
    "draft_model k=4": {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4,
                        "adaptive_draft_length": False},
    "draft_model adaptive": {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4, **PINNED},
    "auto": {"method": "auto", "model": DRAFT, **PINNED},
    "auto measured costs": {"method": "auto", "model": DRAFT},
    "auto without a draft model": {"method": "auto"},
}


@pytest.fixture(scope="module")
def engine():
    return specrs.Engine(TARGET)


@pytest.fixture(scope="module")
def baselines(engine):
    params = SamplingParams(temperature=0, max_tokens=40)
    return [engine.generate(p, params, speculative_config=False).token_ids for p in PROMPTS]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_identity_with_the_0_5b_draft(engine, baselines, name):
    config = CONFIGS[name]
    params = SamplingParams(temperature=0, max_tokens=40)
    num_drafts = 0
    for prompt, baseline in zip(PROMPTS, baselines):
        r = engine.generate(prompt, params, speculative_config=config)
        assert r.token_ids == baseline, f"{name} diverged on {prompt!r}"
        num_drafts += r.metrics["num_drafts"]
        drafters = r.metrics["drafters"]
        if config["method"] == "auto":
            # Every draft is one drafter's, and the counts add up to the request's.
            assert sum(d["num_drafts"] for d in drafters.values()) == r.metrics["num_drafts"]
            assert sum(d["num_accepted_tokens"] for d in drafters.values()) == r.metrics["num_accepted_tokens"]
            assert set(drafters) == ({"suffix", "ngram", "draft_model"} if "model" in config else {"suffix", "ngram"})
        else:
            assert drafters == {}
    if name != "auto measured costs":  # measured costs may rightly judge the draft model not to pay
        assert num_drafts > 0


def test_the_draft_model_drafts_in_auto_where_no_lookup_matches(engine):
    """A prompt this config's suffix cache has not seen (the other tests' responses are in it), so
    where the lookups find nothing the draft model drafts, and it is accepted on code (the 0.5B and
    1.5B coders agree on most tokens)."""
    prompt = "def is_prime(n):\n    \"\"\"Return True when n is a prime number.\"\"\"\n"
    r = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=24), speculative_config=CONFIGS["auto"])
    model = r.metrics["drafters"]["draft_model"]
    assert model["num_drafts"] > 0
    assert model["num_accepted_tokens"] > model["num_drafts"] // 2


def test_sampling_with_the_0_5b_draft_and_auto_matches_plain_sampling(engine):
    """Tokens 2 and 3 have the same joint distribution with and without speculation, over many
    seeds: the draft model's q rows carry the rejection sampling (alone), and auto's drafter draws
    with the target's positional uniforms (coupled, the default)."""
    prompt = engine.tokenizer.encode("My favorite color is")
    params = lambda seed: SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=seed)  # noqa: E731
    configs = {"draft_model": {**CONFIGS["draft_model k=4"], "num_speculative_tokens": 2, "verification": "rejection"},
               "auto": {**CONFIGS["auto"], "num_speculative_tokens": 2}}
    n = 200
    plain = Counter(tuple(engine.generate(prompt, params(s), speculative_config=False).token_ids[1:])
                    for s in range(n))
    for name, config in configs.items():
        speculative, num_drafts = Counter(), 0
        for seed in range(n):
            r = engine.generate(prompt, params(10_000 + seed), speculative_config=config)
            speculative[tuple(r.token_ids[1:])] += 1
            num_drafts += r.metrics["num_drafts"]
        assert num_drafts >= n // 2, name
        assert_same_distribution(plain, speculative)


def test_a_known_model_name_stands_for_its_file_as_a_draft(engine):
    config = json.loads(specrs.engine._config_json(CONFIGS["auto"], engine.info()))
    assert config["model"] == specrs.models.MODELS[DRAFT].path()
    assert config["num_speculative_tokens"] == 8  # auto's default k
