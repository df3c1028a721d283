"""The heads that ship with specrs (python/specrs/heads/, trained here by `specrs train-head`).

- `{"method": "eagle3"}` (and "mlp_speculator" on SmolLM2) finds its head by the loaded model,
  with no path: on SmolLM2-135M-Instruct and on Gemma 3 270M.
- Greedy identity with each shipped head, and the head does its job: it drafts and the target
  accepts some of each draft (a trained head on the target's own kind of text, not a random one).
- The sampled distribution with a shipped head equals plain sampling (two-sample chi-square).
- A model no head ships for gets a ConfigError naming what ships; a config that names its own head
  is left alone.
"""

import json
from pathlib import Path

import pytest
from test_speculative import PROMPTS, assert_same_distribution, chat, sample_with_and_without

import specrs
from specrs import ConfigError, SamplingParams
from specrs.heads import HEAD_METHODS, HEADS_DIR, SHIPPED, shipped_target, with_shipped_head

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 48

SHIPPED_HEADS = [("smollm2-135m", "eagle3"), ("smollm2-135m", "mlp_speculator"), ("gemma3-270m", "eagle3")]


@pytest.fixture(scope="module")
def gemma():
    return specrs.Engine("gemma3-270m")


def engine_for(name, engine, gemma):
    return engine if name == "smollm2-135m" else gemma


def prompts_for(name, engine):
    """Chat prompts for SmolLM2; plain text for Gemma 3 270M (a base model, no chat template)."""
    texts = [PROMPTS["summarization"], PROMPTS["coding"], "Explain how a bicycle stays upright."]
    if name == "smollm2-135m":
        return [chat(t) for t in texts]
    return [engine.tokenizer.encode(t + "\n\n") for t in texts]


def test_every_shipped_head_is_in_the_package_with_its_training_record():
    for name, method in SHIPPED_HEADS:
        head = HEADS_DIR / SHIPPED[name]["heads"][method]
        config = json.loads((head / "config.json").read_text())
        training = json.loads((head / "training.json").read_text())
        assert (head / "model.safetensors").stat().st_size < 40 * 2**20  # shippable: tens of MB at most
        assert training["held_out"]["mean_acceptance_length"] > 1.0, training
        assert config  # the field's format: speculators' EAGLE-3 or IBM's MLP speculator


@pytest.mark.parametrize("name, method", SHIPPED_HEADS)
def test_shipped_head_loads_by_name_keeps_greedy_identity_and_accepts(engine, gemma, name, method):
    target = engine_for(name, engine, gemma)
    assert shipped_target(target.info()) == name
    filled = json.loads(target.config_json({"method": method}))
    assert filled["model"] == str(HEADS_DIR / SHIPPED[name]["heads"][method])
    assert all(filled[key] == value for key, value in HEAD_METHODS[method].items())  # the head's defaults
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    # A fixed length: the default adaptive length may stop drafting where a head does not pay (it
    # does not on this CPU yet, see benches/README.md), and this test is about the head's drafts.
    config = {"method": method, "num_speculative_tokens": 3, "adaptive_draft_length": False}
    accepted = drafts = 0
    for prompt in prompts_for(name, target):
        r = target.generate(prompt, params, speculative_config=config)
        assert r.token_ids == target.generate(prompt, params, speculative_config=False).token_ids
        accepted += r.metrics["num_accepted_tokens"]
        drafts += r.metrics["num_drafts"]
    # Tokens accepted per draft: ~0 for a random head; 0.26-0.50 for these on Spec-Bench.
    assert drafts > 0 and accepted / drafts > 0.15, (accepted, drafts)


def test_engine_default_speculation_finds_the_shipped_head():
    engine = specrs.Engine(speculative_config={"method": "eagle3"})  # the line: no path, no k
    assert engine.speculative_config["model"] == str(HEADS_DIR / SHIPPED["smollm2-135m"]["heads"]["eagle3"])
    assert engine.speculative_config["num_speculative_tokens"] == HEAD_METHODS["eagle3"]["num_speculative_tokens"]
    r = engine.generate(chat(PROMPTS["qa"]), SamplingParams(max_tokens=24, temperature=0.0))
    assert r.token_ids == engine.generate(chat(PROMPTS["qa"]), SamplingParams(max_tokens=24, temperature=0.0),
                                          speculative_config=False).token_ids


@pytest.mark.parametrize("method", ["eagle3", "mlp_speculator"])
def test_sampling_with_a_shipped_head_matches_plain_sampling(engine, method):
    """Tokens 2 and 3 (decided by one k=2 draft) have the same joint distribution with and without
    speculation on SmolLM2 with its shipped head."""
    prompt = chat("Name a color.")
    params = lambda seed: SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=seed, ignore_eos=True)  # noqa: E731
    config = {"method": method, "num_speculative_tokens": 2, "adaptive_draft_length": False}
    n = 500
    plain, speculative, num_drafts = sample_with_and_without(
        engine, prompt, params, n, lambda seed: {"speculative_config": config})
    assert num_drafts >= n
    assert_same_distribution(plain, speculative)


# "auto" with a head: the head's draft cost and the verification curve pinned, so the head's
# turn does not hang on what the machine measures (on this CPU, at measured costs, auto never reads
# SmolLM2's EAGLE-3 head and drafts from its MLP speculator only now and then: benches/README.md).
AUTO_COSTS = {"draft_cost": 0.0, "verify_cost_ratios": [1.0 + 0.2 * n for n in range(9)]}


@pytest.mark.parametrize("method", ["eagle3", "mlp_speculator"])
def test_auto_with_a_shipped_head_drafts_from_it_keeps_greedy_identity_and_plain_sampling(engine, method):
    """The head joins auto's lookups by "draft_method" (its shipped weights filled in, auto's own
    k kept); it sees every step's hidden rows whoever drafted, so its drafts stay right after
    lookup steps; a parallel head is asked for at most its sub-heads' tokens."""
    filled = json.loads(engine.config_json({"method": "auto", "draft_method": method}))
    assert filled["model"] == str(HEADS_DIR / SHIPPED["smollm2-135m"]["heads"][method])
    assert filled["num_speculative_tokens"] == 8  # auto's k, not the head's default
    assert filled.get("quantization") == HEAD_METHODS[method].get("quantization")
    config = {"method": "auto", "draft_method": method, **AUTO_COSTS}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    lookup_drafts = 0
    for prompt in prompts_for("smollm2-135m", engine):
        r = engine.generate(prompt, params, speculative_config=config)
        assert r.token_ids == engine.generate(prompt, params, speculative_config=False).token_ids
        drafters = r.metrics["drafters"]
        for key in counts:
            counts[key] += drafters[method][key]
        lookup_drafts += drafters["suffix"]["num_drafts"] + drafters["ngram"]["num_drafts"]
    assert counts["num_drafts"] > 0 and counts["num_accepted_tokens"] > 0, counts
    assert lookup_drafts > 0, "the lookups drafted between the head's drafts"
    if method == "mlp_speculator":
        assert counts["num_draft_tokens"] <= 3 * counts["num_drafts"], counts  # its 3 sub-heads
    # Seeded sampling couples the head's draws to the target's: plain sampling's tokens.
    sampled = SamplingParams(max_tokens=32, temperature=0.8, seed=11)
    prompt = chat(PROMPTS["coding"])
    r = engine.generate(prompt, sampled, speculative_config=config)
    assert r.token_ids == engine.generate(prompt, sampled, speculative_config=False).token_ids
    assert r.metrics["drafters"][method]["num_drafts"] > 0


def test_no_shipped_head_for_another_model_names_what_ships():
    engine = specrs.Engine(str(ROOT / "tests" / "golden" / "hf" / "llama"))
    with pytest.raises(ConfigError, match=r"no eagle3 head ships for the loaded model.*specrs ships: eagle3 for smollm2-135m"):
        engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4), speculative_config={"method": "eagle3"})
    with pytest.raises(ConfigError, match="no mlp_speculator head ships for the loaded model.*pass \"model\""):
        engine.config_json({"method": "mlp_speculator"})


def test_a_config_that_names_its_own_head_is_left_alone(engine):
    config = {"method": "eagle3", "model": "/somewhere/else"}
    assert with_shipped_head(config, engine.info()) == config
    assert with_shipped_head({"method": "ngram"}, {}) == {"method": "ngram"}
    auto = {"method": "auto", "draft_method": "eagle3", "model": "/somewhere/else"}
    assert with_shipped_head(auto, engine.info()) == auto
