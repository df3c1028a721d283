"""Structured output and logits processing under speculation, on the real default model
(SmolLM2-135M-Instruct): JSON schema, regex, choice and Lark grammars (llguidance), penalties,
logit_bias, min_tokens, stop_token_ids and logprobs must give exactly plain decoding's output with
every proposer; constrained outputs parse and validate; grammar-forced drafts are accepted under
greedy; bad grammars are ConfigErrors naming the problem."""

import json
import re
from collections import Counter

import jsonschema
import numpy as np
import pytest

from specrs import ConfigError, SamplingParams

from test_speculative import TargetGuess, assert_same_distribution

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 20},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "languages"],
    "additionalProperties": False,
}

EXTRACT_PROMPT = [{"role": "user", "content": "Extract the person as JSON with name, age, city and languages: "
                   "Maria Lopez is 34 years old, lives in Madrid and speaks Spanish, English and French."}]
DATE_PROMPT = [{"role": "user", "content": "When did the first person land on the Moon? Answer with the date."}]
COLOR_PROMPT = [{"role": "user", "content": "What color is the sky on a clear day?"}]
HI_PROMPT = [{"role": "user", "content": "Say hi."}]
LIST_PROMPT = [{"role": "user", "content": "List five fruits, one per line, then list them again."}]

# Every proposer family whose drafts can be cut or extended by a grammar: model-free chains (with
# and without the grammar's forced run), "auto" over the lookups and with the shipped EAGLE-3 head,
# a tree, and that head alone.
#
# The adaptive configs pin their verification curve (v(n) = t(n) / t(1)): measured, it follows how
# busy the machine is, and with it the draft lengths the forced-draft counts below depend on.
def pinned_costs(k):
    return {"verify_cost_ratios": [1.0 + 0.05 * n for n in range(k + 1)]}


SPECULATIVE_CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
              **pinned_costs(4)},
    "ngram_no_grammar_drafts": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                "prompt_lookup_max": 3, "grammar_drafts": False, **pinned_costs(4)},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6, **pinned_costs(6)},
    "auto": {"method": "auto", "num_speculative_tokens": 6, **pinned_costs(6)},
    # The shipped EAGLE-3 head beside the lookups, its drafts taken as free so that it drafts.
    "auto_eagle3": {"method": "auto", "draft_method": "eagle3", "num_speculative_tokens": 6, "draft_cost": 0.0,
                    **pinned_costs(6)},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 8, "tree": True, "tree_top_k": 3,
                   "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix_tree": {"method": "suffix", "num_speculative_tokens": 8, "tree": True},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3, "adaptive_draft_length": False},
}

CONSTRAINTS = {
    "json_schema": (EXTRACT_PROMPT, {"json_schema": PERSON_SCHEMA}),
    "json_object": (EXTRACT_PROMPT, {"json_object": True}),
    "regex": (DATE_PROMPT, {"regex": r"(January|February|March|April|May|June|July|August|September|October|"
                            r"November|December) [0-9]{1,2}, [0-9]{4}"}),
    "choice": (COLOR_PROMPT, {"choice": ["blue", "grey", "red at sunset"]}),
    "lark": (COLOR_PROMPT, {"grammar": 'start: "The sky is " COLOR "."\nCOLOR: "blue" | "grey" | "white"'}),
    "penalties": (LIST_PROMPT, {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.3}),
    "logit_bias": (LIST_PROMPT, {"logit_bias": {28: 4.0, 30: -100.0, 9: 2.5}}),
    "min_tokens_stop_ids": (COLOR_PROMPT, {"min_tokens": 12, "stop_token_ids": [30]}),
}


def params(extra, **kw):
    return SamplingParams(**({"max_tokens": 60, "temperature": 0} | kw | extra))


def run(engine, prompt, p, config):
    return engine.generate(prompt, p, speculative_config=config)


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_greedy_identity_with_every_proposer(engine, constraint):
    prompt, extra = CONSTRAINTS[constraint]
    plain = run(engine, prompt, params(extra), False)
    assert plain.token_ids, constraint
    for name, config in SPECULATIVE_CONFIGS.items():
        out = run(engine, prompt, params(extra), config)
        assert out.token_ids == plain.token_ids, f"{constraint} / {name}: {out.text!r} vs plain {plain.text!r}"
        assert out.text == plain.text
        assert out.finish_reason == plain.finish_reason


def test_constrained_outputs_are_valid(engine):
    schema_out = run(engine, EXTRACT_PROMPT, params({"json_schema": PERSON_SCHEMA}), SPECULATIVE_CONFIGS["ngram"])
    jsonschema.validate(json.loads(schema_out.text), PERSON_SCHEMA)
    assert schema_out.finish_reason == "stop"
    choice = run(engine, COLOR_PROMPT, params(CONSTRAINTS["choice"][1]), SPECULATIVE_CONFIGS["suffix"])
    assert choice.text in {"blue", "grey", "red at sunset"}
    date = run(engine, DATE_PROMPT, params(CONSTRAINTS["regex"][1]), SPECULATIVE_CONFIGS["ngram"])
    assert re.fullmatch(CONSTRAINTS["regex"][1]["regex"], date.text), date.text


def test_sampled_constrained_outputs_validate_over_many_seeds(engine):
    texts = engine.generate(
        [EXTRACT_PROMPT] * 24,
        [params({"json_schema": PERSON_SCHEMA}, temperature=1.0, seed=seed) for seed in range(24)],
        speculative_config=SPECULATIVE_CONFIGS["ngram"], progress=False)
    for out in texts:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON_SCHEMA)


def test_grammar_forced_drafts_are_accepted_under_greedy(engine):
    out = run(engine, EXTRACT_PROMPT, params({"json_schema": PERSON_SCHEMA}), SPECULATIVE_CONFIGS["ngram"])
    m = out.metrics
    assert m["num_grammar_draft_tokens"] >= 5, m
    assert m["num_grammar_accepted_tokens"] == m["num_grammar_draft_tokens"], m
    # A tree grows from the end of the forced run (suffix decoding's trees may be single paths, its
    # engine-wide cache having seen this answer in earlier tests).
    for name in ("ngram_tree", "suffix_tree"):
        tree = run(engine, EXTRACT_PROMPT, params({"json_schema": PERSON_SCHEMA}), SPECULATIVE_CONFIGS[name])
        assert tree.token_ids == out.token_ids
        t = tree.metrics
        assert t["num_grammar_draft_tokens"] >= 5 and (t["num_tree_drafts"] > 0 or name == "suffix_tree"), t
        assert t["num_grammar_accepted_tokens"] == t["num_grammar_draft_tokens"], t
    # "auto" opens its drafts with the forced run too: over the lookups alone, and with a model
    # drafter (a head), which drafts only where no forced run opened the step.
    # (The head's config at another k: its own suffix cache, which has not seen this answer in the
    # identity test, so the lookups do not draft the whole answer.)
    fresh_eagle3 = {**SPECULATIVE_CONFIGS["auto_eagle3"], "num_speculative_tokens": 5, **pinned_costs(5)}
    for config in (SPECULATIVE_CONFIGS["auto"], fresh_eagle3):
        auto = run(engine, EXTRACT_PROMPT, params({"json_schema": PERSON_SCHEMA}), config)
        assert auto.token_ids == out.token_ids
        a = auto.metrics
        assert a["num_grammar_draft_tokens"] >= 5, a
        assert a["num_grammar_accepted_tokens"] == a["num_grammar_draft_tokens"], a
    assert a["drafters"]["eagle3"]["num_drafts"] > 0, a["drafters"]
    off = run(engine, EXTRACT_PROMPT, params({"json_schema": PERSON_SCHEMA}),
              SPECULATIVE_CONFIGS["ngram_no_grammar_drafts"])
    assert off.metrics["num_grammar_draft_tokens"] == 0
    # The forced run saves steps: fewer decode steps for the same tokens.
    assert m["num_decode_steps"] < off.metrics["num_decode_steps"], (m, off.metrics)


def test_seeded_sampling_is_plain_sampling_under_a_grammar(engine):
    # One-hot drafts are verified in coupled form: a seeded request emits plain sampling's tokens.
    for seed in range(4):
        for constraint in ("json_schema", "regex", "penalties", "logit_bias"):
            prompt, extra = CONSTRAINTS[constraint]
            p = params(extra, temperature=0.9, seed=seed)
            plain = run(engine, prompt, p, False)
            spec = run(engine, prompt, p, SPECULATIVE_CONFIGS["ngram"])
            assert spec.token_ids == plain.token_ids, (constraint, seed)


def first_tokens(results, n=3):
    return Counter(tuple(r.token_ids[:n]) for r in results)


@pytest.mark.parametrize("case", ["choice", "regex_with_probs"])
def test_two_sample_distribution_with_a_grammar(engine, case):
    """Plain constrained sampling and speculative constrained sampling (independent seeds) draw
    the same distribution of openings: ngram drafts, and drafts with probabilities whose
    forbidden tokens are rejected, never cut."""
    if case == "choice":
        prompt = [{"role": "user", "content": "Name a color you like."}]
        extra = {"choice": ["blue", "bright blue", "green", "light green", "red", "dark red"]}
        config = SPECULATIVE_CONFIGS["ngram"]
        proposer = None
    else:
        # The drafts are unconstrained target guesses, which the grammar often forbids (" And",
        # ","): such a token must be rejected (and its probability row used), never cut.
        prompt = [{"role": "user", "content": "Name an animal and a color."}]
        extra = {"regex": r"(cat|dog|cow|fox|owl) and (red|blue|green|pink)"}
        config = {"method": "custom", "num_speculative_tokens": 1}
        proposer = TargetGuess(engine, 7, sharpen=True)  # draft tokens drawn, with their probabilities
    n = 300
    plain = [run(engine, prompt, params(extra, temperature=1.0, seed=s, max_tokens=4), False) for s in range(n)]
    spec = [engine.generate(prompt, params(extra, temperature=1.0, seed=10_000 + s, max_tokens=4),
                            speculative_config=config, proposer=proposer) for s in range(n)]
    assert_same_distribution(first_tokens(plain), first_tokens(spec))
    if proposer is not None:
        assert sum(r.metrics["num_draft_tokens"] for r in spec) > 100


def test_logprobs_equal_plain_decoding(engine):
    for constraint in ("json_schema", "penalties"):
        prompt, extra = CONSTRAINTS[constraint]
        for temperature in (0.0, 0.8):
            p = params(extra, logprobs=3, temperature=temperature, seed=5)
            plain = run(engine, prompt, p, False)
            spec = run(engine, prompt, p, SPECULATIVE_CONFIGS["ngram"])
            assert spec.token_ids == plain.token_ids
            assert len(plain.logprobs) == len(plain.token_ids)
            for a, b, token in zip(plain.logprobs, spec.logprobs, plain.token_ids):
                assert a["token_id"] == b["token_id"] == token
                assert abs(a["logprob"] - b["logprob"]) < 1e-4, (a, b)
                assert [t for t, _ in a["top_logprobs"]] == [t for t, _ in b["top_logprobs"]]
                assert np.allclose([lp for _, lp in a["top_logprobs"]], [lp for _, lp in b["top_logprobs"]],
                                   atol=1e-4)
                # Alternatives the grammar rules out are left out: fewer than 3 where it forces one.
                assert 1 <= len(a["top_logprobs"]) <= 3 and a["logprob"] <= 0.0
                if constraint == "penalties":
                    assert len(a["top_logprobs"]) == 3
    # Greedy under a grammar: the chosen token is the most likely allowed one.
    out = run(engine, EXTRACT_PROMPT, params({"json_schema": PERSON_SCHEMA}, logprobs=1), False)
    for entry in out.logprobs:
        assert entry["top_logprobs"][0][0] == entry["token_id"]
    assert run(engine, COLOR_PROMPT, params({}), False).logprobs is None


def test_min_tokens_and_stop_token_ids(engine):
    eos = engine.tokenizer.eos_token_ids
    short = run(engine, HI_PROMPT, params({}), False)
    assert short.finish_reason == "stop" and len(short.token_ids) < 30
    longer = run(engine, HI_PROMPT, params({"min_tokens": len(short.token_ids) + 5}), False)
    assert len(longer.token_ids) >= len(short.token_ids) + 5
    assert not any(t in eos for t in longer.token_ids[: len(short.token_ids) + 4])
    # Stop at the first "." of the answer (whatever its token id): the token is kept, finish "stop".
    period = short.token_ids[0]
    stopped = run(engine, HI_PROMPT, params({"stop_token_ids": [period]}), False)
    assert stopped.token_ids == [period] and stopped.finish_reason == "stop"


def test_bad_grammars_and_settings_are_config_errors(engine):
    bad = [
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "json"),
        ({"regex": "([a-z"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
    ]
    for extra, word in bad:
        with pytest.raises(ConfigError, match=f"(?i)invalid .*{word}"):
            engine.generate(COLOR_PROMPT, params(extra), speculative_config=False)
    with pytest.raises(ConfigError, match="at most one of"):
        SamplingParams(regex="a+", choice=["a"])
    with pytest.raises(ConfigError, match="choice"):
        SamplingParams(choice=[])
    with pytest.raises(ConfigError, match="presence_penalty"):
        SamplingParams(presence_penalty=3.0)
    with pytest.raises(ConfigError, match="logit_bias"):
        engine.generate(COLOR_PROMPT, SamplingParams(logit_bias={10**6: 1.0}), speculative_config=False)
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ConfigError, match="grammar_drafts"):
        engine.generate(COLOR_PROMPT, params({}), speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                      "grammar_drafts": 3})
