"""`specrs serve` structured output and per-token settings through the official `openai` client:
`response_format` (json_object, json_schema), vLLM's `guided_*` and `structured_outputs`,
`logprobs` / `top_logprobs` (chat) and `logprobs` (completions), streamed and not, penalties,
`logit_bias`, `min_tokens`, `stop_token_ids`; each answer equals the engine's own plain decoding
of the same settings, and bad grammars are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

import specrs
from test_serve import _error, client, model_name, server  # noqa: F401 (fixtures)
from test_structured import PERSON_SCHEMA

openai = pytest.importorskip("openai")

EXTRACT = ("Extract the person as JSON: Maria Lopez is 34 years old, lives in Madrid and speaks Spanish, "
           "English and French.")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _chat(client, model_name, content, stream=False, max_tokens=80, **extra):  # noqa: F811
    kwargs = {"model": model_name, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
              "temperature": 0, "stream": stream}
    for key in ("response_format", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
                "logit_bias"):
        if key in extra:
            kwargs[key] = extra.pop(key)
    out = client.chat.completions.create(**kwargs, extra_body={"speculative": NGRAM} | extra)
    if not stream:
        choice = out.choices[0]
        entries = choice.logprobs.content if choice.logprobs else None
        return choice.message.content, choice.finish_reason, entries
    text, finish, entries = "", None, []
    for chunk in out:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
        if choice.logprobs and choice.logprobs.content:
            entries.extend(choice.logprobs.content)
    return text, finish, entries


def _local(engine, content, max_tokens=80, **settings):
    return engine.generate([{"role": "user", "content": content}],
                           specrs.SamplingParams(temperature=0, max_tokens=max_tokens, **settings),
                           speculative_config=False)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(engine, client, model_name, stream):  # noqa: F811
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA,
                                                              "strict": True}}
    text, finish, _ = _chat(client, model_name, EXTRACT, stream, response_format=response_format)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    assert finish == "stop"
    assert text == _local(engine, EXTRACT, json_schema=PERSON_SCHEMA).text
    text, finish, _ = _chat(client, model_name, 'Reply with a JSON object whose key "city" is Paris.', stream,
                            max_tokens=64, response_format={"type": "json_object"})
    assert text.startswith("{") and finish == "stop", text
    assert isinstance(json.loads(text), dict)


def test_vllm_guided_fields(engine, client, model_name):  # noqa: F811
    question = "What color is the sky on a clear day?"
    text, _, _ = _chat(client, model_name, question, guided_choice=["blue", "green"])
    assert text in ("blue", "green")
    text, _, _ = _chat(client, model_name, question, guided_regex="The sky is [a-z]+\\.")
    assert text.startswith("The sky is ") and text.endswith(".")
    assert text == _local(engine, question, regex="The sky is [a-z]+\\.").text
    text, _, _ = _chat(client, model_name, question, structured_outputs={"choice": ["blue", "grey"]})
    assert text in ("blue", "grey")
    text, _, _ = _chat(client, model_name, question, guided_grammar='start: "It is " ("blue" | "grey")')
    assert text in ("It is blue", "It is grey")
    text, _, _ = _chat(client, model_name, EXTRACT, guided_json=PERSON_SCHEMA)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_match_the_engine(engine, client, model_name, stream):  # noqa: F811
    question = "Name three rivers in Europe."
    text, _, entries = _chat(client, model_name, question, stream, max_tokens=24, logprobs=True, top_logprobs=2)
    local = _local(engine, question, max_tokens=24, logprobs=2)
    assert text == local.text
    assert len(entries) == len(local.token_ids)
    tokenizer = engine.tokenizer
    for entry, mine in zip(entries, local.logprobs):
        assert entry.token == tokenizer.decode([mine["token_id"]], skip_special_tokens=False)
        assert abs(entry.logprob - mine["logprob"]) < 1e-4
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes) == entry.token.encode()


def test_completion_logprobs(engine, client, model_name):  # noqa: F811
    out = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=8,
                                    temperature=0, logprobs=3, extra_body={"speculative": NGRAM})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert all(len(top) <= 3 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    local = engine.generate("The capital of France is", specrs.SamplingParams(temperature=0, max_tokens=8, logprobs=3),
                            speculative_config=False)
    assert [round(x, 4) for x in lp.token_logprobs] == [round(e["logprob"], 4) for e in local.logprobs]


def test_penalties_bias_min_tokens_stop_ids(engine, client, model_name):  # noqa: F811
    question = "List five fruits, one per line, then list them again."
    settings = {"presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                "logit_bias": {"28": 3.0, "30": -100}}
    text, _, _ = _chat(client, model_name, question, max_tokens=48, **settings)
    local = _local(engine, question, max_tokens=48, presence_penalty=0.8, frequency_penalty=0.5,
                   repetition_penalty=1.2, logit_bias={28: 3.0, 30: -100.0})
    assert text == local.text
    short = _local(engine, "Say hi.", max_tokens=48)
    text, finish, _ = _chat(client, model_name, "Say hi.", max_tokens=48, min_tokens=len(short.token_ids) + 6)
    assert text == _local(engine, "Say hi.", max_tokens=48, min_tokens=len(short.token_ids) + 6).text
    first = short.token_ids[0]
    # As in vLLM, the stop token ends the answer without its text, unless include_stop_str_in_output.
    text, finish, _ = _chat(client, model_name, "Say hi.", max_tokens=48, stop_token_ids=[first])
    assert finish == "stop" and text == ""
    text, finish, _ = _chat(client, model_name, "Say hi.", max_tokens=48, stop_token_ids=[first],
                            include_stop_str_in_output=True)
    assert finish == "stop" and text == engine.tokenizer.decode([first])


def test_structured_bad_requests(server, model_name):  # noqa: F811
    chat = "/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties":
                                                                                   {"a": {"type": "nonsense"}}}}}
    error = _error(server, chat, {"messages": messages, "response_format": bad_schema}, 400)
    assert error["param"] == "response_format" and "json" in error["message"].lower()
    error = _error(server, chat, {"messages": messages, "guided_regex": "([a-z"}, 400)
    assert error["param"] == "guided_regex" and "regex" in error["message"]
    error = _error(server, chat, {"messages": messages, "guided_regex": "a", "guided_choice": ["a"]}, 400)
    assert "at most one" in error["message"]
    assert _error(server, chat, {"messages": messages, "top_logprobs": 2}, 400)["param"] == "top_logprobs"
    assert _error(server, chat, {"messages": messages, "logprobs": True, "top_logprobs": 21}, 400)["param"] == \
        "top_logprobs"
    assert _error(server, chat, {"messages": messages, "response_format": {"type": "xml"}}, 400)["param"] == \
        "response_format"
    assert "logit_bias" in _error(server, chat, {"messages": messages, "logit_bias": {"99999999": 1}}, 400)["message"]
    assert "presence_penalty" in _error(server, chat, {"messages": messages, "presence_penalty": 5}, 400)["message"]
