"""A speculative config is parsed once into a `SpeculativeConfig` (Rust's parsed config behind the
binding), which every call taking a config accepts as it is, beside the JSON text it still takes."""

import json

import pytest

import specrs
import specrs.engine as engine_module
from specrs import SamplingParams, _specrs
from specrs.serve import protocol

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
PROMPT = [{"role": "user", "content": "List the days of the week, then list them again in the same order."}]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture
def parse_calls(monkeypatch):
    """Every config `specrs.engine` and the server parse, counted (`_parse_config` is their one parse)."""
    calls = []

    def counting(config, target_info=None):
        calls.append(config)
        return parse(config, target_info)

    parse = engine_module._parse_config
    monkeypatch.setattr(engine_module, "_parse_config", counting)
    monkeypatch.setattr(protocol, "_parse_config", counting)
    return calls


def test_the_object_says_what_rusts_parse_says(engine):
    config = engine.parse_config({"method": "suffix", "num_speculative_tokens": 6, "adaptive_draft_length": False})
    assert isinstance(config, specrs.SpeculativeConfig)
    assert config.to_json() == engine.config_json(json.loads(config.to_json()))
    assert _specrs.SpeculativeConfig.from_json(config.to_json()).to_json() == config.to_json()
    assert json.loads(config.to_json())["suffix_decoding_max_tree_depth"] == 24  # defaults filled in
    assert (config.method, config.num_speculative_tokens, config.adaptive_draft_length) == ("suffix", 6, False)
    assert config.keeps_suffix_cache and config.weights() is None
    ngram = engine.parse_config(json.dumps(NGRAM))
    assert ngram.method == "ngram" and ngram.adaptive_draft_length and not ngram.keeps_suffix_cache
    assert engine.parse_config({"method": "auto"}).keeps_suffix_cache
    draft = _specrs.SpeculativeConfig.from_json('{"method": "draft", "model": "d.gguf", "num_speculative_tokens": 3}')
    assert draft.method == "draft_model"
    assert draft.weights() == {"method": "draft_model", "model": "d.gguf"}
    assert draft.verification == "auto"
    assert _specrs.SpeculativeConfig.from_json(
        '{"method": "draft", "model": "d.gguf", "num_speculative_tokens": 3, "verification": "rejection"}'
    ).verification == "rejection"
    assert engine.parse_config(config) is config  # parsed already: returned as it is


@pytest.mark.parametrize("text, message", [
    ('{"method": "ngram", "num_spec_tokens": 4}', "did you mean 'num_speculative_tokens'"),
    ('{"method": "ngarm"}', "did you mean 'ngram'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in 1..="),
    ("{not json", "not valid JSON"),
])
def test_a_bad_config_raises_the_same_config_error_as_its_json_does(engine, text, message):
    with pytest.raises(specrs.ConfigError, match=message) as parsed:
        _specrs.SpeculativeConfig.from_json(text)
    ids = engine.prompt_token_ids("Hello")
    with pytest.raises(specrs.ConfigError) as generated:
        engine._inner.generate(ids, GREEDY, text)
    with pytest.raises(specrs.ConfigError) as added:
        _specrs.Scheduler(engine._inner, cost_curve_s=[1.0] * 8).add(0, ids, GREEDY, text)
    with pytest.raises(specrs.ConfigError) as through_python:
        engine.generate("Hello", GREEDY, speculative_config=text)
    assert str(parsed.value) == str(generated.value) == str(added.value) == str(through_python.value)


def test_a_config_argument_of_another_type_is_a_config_error(engine):
    ids = engine.prompt_token_ids("Hello")
    with pytest.raises(specrs.ConfigError, match="a SpeculativeConfig or its JSON text \\(got dict\\)"):
        engine._inner.generate(ids, GREEDY, NGRAM)
    with pytest.raises(specrs.ConfigError, match="a SpeculativeConfig or its JSON text \\(got int\\)"):
        engine._inner.prepare(4)


def test_the_object_runs_as_its_json_does(engine):
    config = engine.parse_config(NGRAM)
    by_dict = engine.generate(PROMPT, GREEDY, speculative_config=NGRAM)
    by_object = engine.generate(PROMPT, GREEDY, speculative_config=config)
    ids = engine.prompt_token_ids(PROMPT)
    by_json = engine._inner.generate(ids, GREEDY, config.to_json())
    assert by_object.token_ids == by_dict.token_ids == by_json["token_ids"]
    assert by_object.metrics["num_drafts"] > 0  # it speculated
    assert "".join(engine.stream(PROMPT, GREEDY, speculative_config=config)) == by_object.text
    results = {}
    for form in ("object", "json"):
        scheduler = _specrs.Scheduler(engine._inner, cost_curve_s=[1.0] * 8)
        scheduler.add(0, ids, GREEDY, config if form == "object" else config.to_json())
        scheduler.add_samples([1, 2], ids, SamplingParams(temperature=0, max_tokens=24, n=2),
                              config if form == "object" else config.to_json())
        results[form] = [r.token_ids for r in engine_module._run_to_the_end(scheduler, 3, None)]
    assert results["object"] == results["json"] == [by_object.token_ids] * 3
    assert engine.prepare(config)["verify_cost_ratios"][0] == 1.0


def test_a_request_parses_its_config_once(engine, parse_calls):
    engine.generate([PROMPT, "Count to five.", "Hi"], GREEDY, speculative_config=NGRAM, progress=False)
    assert parse_calls == [NGRAM]  # one parse for the three requests
    parse_calls.clear()
    config = engine.parse_config(NGRAM)
    engine.generate(PROMPT, GREEDY, speculative_config=config)
    engine.generate_samples(PROMPT, SamplingParams(temperature=0, max_tokens=8, n=2), speculative_config=config)
    assert parse_calls == [NGRAM]  # only parse_config's


def test_the_servers_request_config_is_parsed_once_and_run_as_it_is(engine, parse_calls):
    speculation = protocol.ServerSpeculation(None, target_info=engine.info())
    config = speculation.for_request(NGRAM)
    assert engine._speculation(config, None) == (config, None)  # the scheduler's add takes it as it is
    assert parse_calls == [NGRAM]
    assert config.to_json() == engine.config_json(NGRAM)
    default = protocol.ServerSpeculation(json.loads(config.to_json()))
    assert default.for_request(None) is default.for_request(True) is default.parsed  # parsed at startup
    assert default.for_request(False) is None
