"""Token-tree speculation on the real models (SmolLM2-135M-Instruct and Gemma 3 270M):

- greedy identity with trees for every proposer (n-gram, suffix, the shipped EAGLE-3 and MLP
  speculator heads, a draft model, a custom proposer) at several node budgets, with fixed trees,
  the automatic chooser and a static `speculative_token_tree`;
- sampling: a tree of deterministic drafts emits exactly the tokens plain sampling draws with the
  same seed; a tree with draft probabilities (children drawn from q without replacement) keeps the
  target distribution (two-sample chi-square against plain sampling);
- tree statistics in the metrics, and configs refused with what to change.
"""

import json

import numpy as np
import pytest
from test_speculative import PROMPTS, assert_same_distribution, chat, sample_with_and_without

import specrs
from specrs import ConfigError, SamplingParams

MAX_TOKENS = 40
BUDGETS = [4, 8, 16]

# Each proposer's settings; the tree keys are added per test.
METHODS = {
    "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "suffix_decoding_min_token_prob": 0.0},
    "eagle3": {"method": "eagle3"},
    "mlp_speculator": {"method": "mlp_speculator", "tree_depth": 3},
    "quantized_self": {"method": "quantized_self"},
}
GEMMA_METHODS = ["ngram", "suffix", "eagle3"]


@pytest.fixture(scope="module")
def gemma():
    return specrs.Engine("gemma3-270m")


def smollm2_prompts(engine):
    return [engine.prompt_token_ids(chat(PROMPTS[name])) for name in ("summarization", "coding", "rag")]


def gemma_prompts():
    return [
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "The Amazon river flows through Peru, Colombia and Brazil. The Amazon river is",
        "Question: What is the capital of France?\nAnswer:",
    ]


def tree_configs(method, budget):
    base = METHODS[method]
    yield {**base, "num_speculative_tokens": budget, "tree": True, "tree_top_k": 3}
    yield {**base, "num_speculative_tokens": budget, "tree": "auto"}


def assert_greedy_identity(engine, prompts, config):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    num_drafts = 0
    for prompt in prompts:
        plain = engine.generate(prompt, params, speculative_config=False).token_ids
        r = engine.generate(prompt, params, speculative_config=config)
        assert r.token_ids == plain, f"{config}: {prompt[:12]!r}"
        num_drafts += r.metrics["num_drafts"]
    return num_drafts


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_identity_with_trees_on_smollm2(engine, method, budget):
    num_tree_drafts = 0
    for config in tree_configs(method, budget):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for prompt in smollm2_prompts(engine):
            plain = engine.generate(prompt, params, speculative_config=False).token_ids
            r = engine.generate(prompt, params, speculative_config=config)
            assert r.token_ids == plain, f"{config}: {prompt[:12]!r}"
            num_tree_drafts += r.metrics["num_tree_drafts"]
    # Every proposer but none drafts real trees (more than one child somewhere) at these budgets.
    assert num_tree_drafts > 0, f"{method} at budget {budget} never drafted a tree"


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("method", GEMMA_METHODS)
def test_greedy_identity_with_trees_on_gemma3(gemma, method, budget):
    for config in tree_configs(method, budget):
        assert_greedy_identity(gemma, gemma_prompts(), config)


def test_static_token_tree(engine, gemma):
    """vLLM's `speculative_token_tree`: drafts are pruned to the listed rank paths."""
    tree = "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"
    for e, prompts in ((engine, smollm2_prompts(engine)), (gemma, gemma_prompts())):
        for method in ("ngram", "eagle3"):
            config = {**METHODS[method], "speculative_token_tree": tree}
            assert assert_greedy_identity(e, prompts, config) > 0
    parsed = json.loads(engine.config_json({"method": "ngram", "speculative_token_tree": tree}))
    assert parsed["num_speculative_tokens"] == 6 and parsed["tree"] is True
    assert parsed["speculative_token_tree"][5] == [0, 0, 0]


class TopTwoTree:
    """A custom tree proposer from the target's own logits (cached per context): two children under
    the newest token. Deterministic (the target's top 2, no probabilities), or, with `probs`, drawn
    from a sharpened target distribution q in order without replacement and returned with q."""

    cache: dict = {}

    def __init__(self, engine, seed, probs):
        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.probs = probs

    def propose(self, context_ids, max_tokens):
        key = tuple(context_ids)
        if key not in self.cache:
            self.cache[key] = self.engine.logits(context_ids)[-1].astype(np.float64)
        logits = self.cache[key]
        if not self.probs:
            top = np.argsort(-logits)[:2]
            return [int(t) for t in top], None, [-1, -1]
        q = np.exp((logits - logits.max()) / 0.7)
        q /= q.sum()
        first = int(self.rng.choice(len(q), p=q))
        rest = q.copy()
        rest[first] = 0.0
        second = int(self.rng.choice(len(q), p=rest / rest.sum()))
        rows = np.stack([q, q]).astype(np.float32)
        return [first, second], rows, [-1, -1]


@pytest.mark.parametrize("with_probs", [False, True])
def test_sampling_with_trees_matches_plain_sampling(engine, with_probs):
    """Tokens 2 and 3 (decided by one two-child tree) have the same joint distribution with and
    without speculation."""
    prompt = engine.tokenizer.encode("My favorite color is")
    params = lambda seed: SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=seed)  # noqa: E731
    config = {"method": "custom", "num_speculative_tokens": 2, "tree": True, "tree_top_k": 2, "tree_depth": 1}
    n = 400
    plain, speculative, num_drafts = sample_with_and_without(
        engine, prompt, params, n,
        lambda seed: {"speculative_config": config, "proposer": TopTwoTree(engine, seed, with_probs)},
    )
    assert num_drafts >= n
    assert_same_distribution(plain, speculative)


@pytest.mark.parametrize("method", ["ngram", "suffix", "eagle3"])
def test_sampled_deterministic_trees_emit_the_plain_tokens(engine, method):
    """Deterministic trees are verified in coupled form: each position's token is the one plain
    sampling draws there with the same seed, whatever the tree."""
    prompt = chat(PROMPTS["summarization"])
    config = {**METHODS[method], "num_speculative_tokens": 8, "tree": True}
    for seed in range(3):
        params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=seed)
        plain = engine.generate(prompt, params, speculative_config=False).token_ids
        assert engine.generate(prompt, params, speculative_config=config).token_ids == plain


def test_tree_statistics_in_the_metrics(engine):
    config = {**METHODS["ngram"], "num_speculative_tokens": 8, "tree": True, "tree_top_k": 4}
    r = engine.generate(smollm2_prompts(engine)[0], SamplingParams(temperature=0, max_tokens=64),
                        speculative_config=config)
    m = r.metrics
    assert 0 < m["num_tree_drafts"] <= m["num_drafts"]
    assert m["num_tree_draft_tokens"] <= m["num_draft_tokens"] <= 8 * m["num_drafts"]
    assert m["num_tree_accepted_tokens"] <= m["num_accepted_tokens"]
    assert m["num_tree_drafts"] <= m["tree_depth_sum"] <= 8 * m["num_tree_drafts"]


@pytest.mark.parametrize("config, needle", [
    ({"method": "ngram", "num_speculative_tokens": 4, "tree": "sometimes"}, "false, true or \"auto\""),
    ({"method": "ngram", "num_speculative_tokens": 4, "tree_depth": 2}, "set \"tree\""),
    ({"method": "ngram", "num_speculative_tokens": 4, "speculative_token_tree": "[(0,), (1,)]"}, "must be equal"),
    ({"method": "ngram", "speculative_token_tree": "[(0,), (0,)]"}, "listed twice"),
    ({"method": "ngram", "speculative_token_tree": "[(1,)]"}, "higher-ranked sibling"),
    ({"method": "ngram", "num_speculative_tokens": 4, "tree": True, "adaptive_draft_length": True}, "\"auto\""),
    ({"method": "mlp_speculator", "num_speculative_tokens": 8, "tree": True, "tree_depth": 5}, "tree_depth"),
])
def test_bad_tree_configs_say_what_to_change(engine, config, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        engine.generate("Hello", SamplingParams(temperature=0, max_tokens=4), speculative_config=config)


def test_a_chain_request_refuses_a_custom_tree(engine):
    class Tree:
        def propose(self, context_ids, max_tokens):
            return [1, 2], None, [-1, -1]

    # A fixed draft length: the cost-aware one depends on this proposer's measured cost and may ask
    # for fewer tokens (or none) than the tree has.
    with pytest.raises(specrs.ProposerError, match="set \"tree\""):
        engine.generate("Hello", SamplingParams(temperature=0, max_tokens=4), proposer=Tree(),
                        speculative_config={"method": "custom", "num_speculative_tokens": 2,
                                            "adaptive_draft_length": False})


def test_a_custom_tree_deeper_than_the_planned_depth_is_cut_to_it(engine):
    """A Python proposer is told the node budget, not the depth the engine plans for the step: its
    deeper tokens are dropped, not refused, and the output stays plain decoding's."""
    prompt = engine.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = engine.generate(prompt, params, speculative_config=False).token_ids

    class DeepTree:
        """The plain continuation as a 5-deep path, with a wrong sibling beside its first token."""

        def propose(self, context_ids, max_tokens):
            right = plain[len(context_ids) - len(prompt):][:max_tokens - 1]
            if not right:
                return []
            # r0 and its wrong sibling under the newest token, r1 under r0 (node 0), r_j under r_(j-1) (node j).
            parents = [-1, -1] + [0] * (len(right) > 1) + list(range(2, len(right)))
            return [right[0], (right[0] + 1) % 1000, *right[1:]], None, parents

    config = {"method": "custom", "num_speculative_tokens": 6, "tree": True, "tree_depth": 2}
    out = engine.generate(prompt, params, speculative_config=config, proposer=DeepTree())
    m = out.metrics
    assert out.token_ids == plain
    assert m["num_tree_drafts"] > 0 and m["tree_depth_sum"] <= 2 * m["num_tree_drafts"], m
    assert m["num_accepted_tokens"] >= m["num_tree_drafts"], m


def test_trees_in_a_continuous_batch(engine):
    """The scheduler batches tree rows of several requests in one forward: outputs stay those of
    plain decoding alone."""
    prompts = smollm2_prompts(engine)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [engine.generate(p, params, speculative_config=False).token_ids for p in prompts]
    for config in ({**METHODS["ngram"], "num_speculative_tokens": 8, "tree": True},
                   {**METHODS["eagle3"], "num_speculative_tokens": 8, "tree": "auto", "tree_depth": 4}):
        results = engine.generate(prompts, params, speculative_config=config, progress=False)
        assert [r.token_ids for r in results] == plain, config
