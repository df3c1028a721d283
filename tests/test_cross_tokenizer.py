"""Drafts from a model with another tokenizer (`"method": "draft_model"` whose draft's vocabulary
is not the target's; proposer/cross_tokenizer.rs): SmolLM2-135M (byte-level BPE) and Gemma 3 270M
(SentencePiece with byte fallback) draft for each other. Greedy identity at every k in both
directions, drafts that are accepted, and the sampled distribution unchanged. (The methods that
still need the target's tokenizer refuse such a draft: test_draft_models.py.)"""

import pytest
from test_speculative import PROMPTS, assert_same_distribution, chat, sample_with_and_without

import specrs
from specrs import SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gemma():
    return specrs.Engine("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_path(gemma):
    return specrs.models.find_model("gemma3-270m").path()


def spec(draft_path, k, **extra):
    return {"method": "draft_model", "model": draft_path, "num_speculative_tokens": k,
            "adaptive_draft_length": False, **extra}


def greedy(engine, prompt, speculative_config):
    return engine.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           speculative_config=speculative_config)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_smollm2_drafting_for_gemma_is_greedy_identical_and_accepted(gemma, model_path, k):
    """Gemma 3 is a base model with no chat template: plain-text prompts."""
    accepted = 0
    for text in list(PROMPTS.values())[:3]:
        plain = greedy(gemma, text, False)
        r = greedy(gemma, text, spec(model_path, k))
        assert r.token_ids == plain.token_ids, f"k={k} diverged on {text[:40]!r}"
        accepted += r.metrics["num_accepted_tokens"]
    assert accepted > 0, "SmolLM2 guesses some of Gemma's tokens"


@pytest.mark.parametrize("k", [1, 4])
def test_gemma_drafting_for_smollm2_is_greedy_identical_and_accepted(engine, gemma_path, k):
    accepted = 0
    for text in PROMPTS.values():
        plain = greedy(engine, chat(text), False)
        r = greedy(engine, chat(text), spec(gemma_path, k))
        assert r.token_ids == plain.token_ids, f"k={k} diverged on {text[:40]!r}"
        accepted += r.metrics["num_accepted_tokens"]
    assert accepted > 0, "Gemma guesses some of SmolLM2's tokens"


def test_a_cross_tokenizer_draft_keeps_the_sampled_distribution(engine, gemma_path):
    """Tokens 2 and 3 (both decided by one k=2 draft where the text gives two tokens) have the
    same joint distribution with and without the Gemma draft, over many seeds."""
    prompt = engine.tokenizer.encode("My favorite color is")
    params = lambda seed: SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=seed)  # noqa: E731
    n = 400
    plain, speculative, num_drafts = sample_with_and_without(
        engine, prompt, params, n, lambda seed: {"speculative_config": spec(gemma_path, 2)}
    )
    assert num_drafts >= n // 2, num_drafts
    assert_same_distribution(plain, speculative)

