"""Tool calls through `specrs serve` with the official `openai` client: `tools` + `tool_choice`
(named, required, auto, none), streamed and not; a forced call always parses and validates against
its function's schema, is the same with and without speculation, and round-trips (the call and
its result sent back as history); bad tools are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from test_serve import _error, client, model_name, server  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                                    "max_results": {"type": "integer", "minimum": 1, "maximum": 5}},
                   "required": ["query", "max_results"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now, in celsius?"}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _call(client, model_name, stream, tool_choice, tools=(WEATHER,), messages=QUESTION, speculative=None):  # noqa: F811
    out = client.chat.completions.create(
        model=model_name, messages=list(messages), tools=list(tools), tool_choice=tool_choice, max_tokens=80,
        temperature=0, stream=stream, extra_body={} if speculative is None else {"speculative": speculative})
    if not stream:
        choice = out.choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, finish, calls = "", None, {}
    for chunk in out:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return content or None, [(c["id"], c["name"], c["arguments"]) for c in calls.values()], finish


def _check(call, tool):
    _, name, arguments = call
    assert name == tool["function"]["name"]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_calls(client, model_name, stream):  # noqa: F811
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = _call(client, model_name, stream, named, tools=(SEARCH, WEATHER))
    assert finish == "tool_calls" and content is None and len(calls) == 1, (content, calls, finish)
    _check(calls[0], WEATHER)
    assert calls[0][0].startswith("call_")
    assert json.loads(calls[0][2])["city"] == "Paris"
    content, calls, finish = _call(client, model_name, stream, "required", tools=(SEARCH, WEATHER))
    assert finish == "tool_calls" and len(calls) == 1
    _check(calls[0], WEATHER if calls[0][1] == "get_weather" else SEARCH)
    # Speculation changes nothing (greedy): the same arguments with and without n-gram drafts.
    plain = _call(client, model_name, stream, named, speculative=False)[1][0][1:]
    assert _call(client, model_name, stream, named, speculative=NGRAM)[1][0][1:] == plain


def test_a_constrained_call_streams_its_arguments_as_they_are_generated(client, model_name):  # noqa: F811
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=model_name, messages=QUESTION, tools=[WEATHER], tool_choice=named,
                                         max_tokens=80, temperature=0, stream=True)
    pieces = [delta.function.arguments for chunk in out for choice in chunk.choices
              for delta in choice.delta.tool_calls or [] if delta.function is not None and delta.function.arguments]
    assert len(pieces) > 3, pieces  # token by token, not one piece at the end
    # The same arguments text as the whole answer's.
    assert "".join(pieces) == _call(client, model_name, False, named)[1][0][2]


def test_auto_and_none(client, model_name):  # noqa: F811
    content, calls, finish = _call(client, model_name, False, "auto")
    if calls:  # the model chose to call: it must be a valid call
        assert finish == "tool_calls" and content is None
        _check(calls[0], WEATHER)
    else:
        assert content and finish in ("stop", "length")
    content, calls, finish = _call(client, model_name, False, "none")
    assert content and not calls


def test_tool_round_trip(client, model_name):  # noqa: F811
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, calls, _ = _call(client, model_name, False, named)
    call_id, name, arguments = calls[0]
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature": 18, "sky": "cloudy"})},
    ]
    content, calls, finish = _call(client, model_name, False, "none", messages=history)
    assert content and not calls and finish in ("stop", "length")


def test_bad_tools(server, model_name):  # noqa: F811
    chat = "/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    assert _error(server, chat, {"messages": messages, "tools": [{"type": "web"}]}, 400)["param"] == "tools"
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    assert _error(server, chat, {"messages": messages, "tools": [bad_schema]}, 400)["param"] == "tools"
    error = _error(server, chat, {"messages": messages, "tools": [WEATHER],
                                  "tool_choice": {"type": "function", "function": {"name": "missing"}}}, 400)
    assert error["param"] == "tool_choice" and "missing" in error["message"]
    assert _error(server, chat, {"messages": messages, "tool_choice": "required"}, 400)["param"] == "tool_choice"
    error = _error(server, chat, {"messages": messages, "tools": [WEATHER], "tool_choice": "required",
                                  "response_format": {"type": "json_object"}}, 400)
    assert error["param"] == "tool_choice"


# A schema that declares `city` and does not forbid other keys: the question invites a `unit`.
OPEN_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_strict_tool_call_carries_only_declared_keys(client, model_name, stream):  # noqa: F811
    """OpenAI's strict mode: `"strict": true` closes every object of the parameters, so a
    required call carries exactly the declared keys; without it the schema is held as written
    (the model adds a `unit` here, which the open schema allows)."""
    _, (loose,), _ = _call(client, model_name, stream, "required", tools=(OPEN_WEATHER,))
    _check(loose, OPEN_WEATHER)
    assert set(json.loads(loose[2])) > {"city"}, "the open schema lets the model add keys (so strict matters)"
    strict = {"type": "function", "function": {**OPEN_WEATHER["function"], "strict": True}}
    _, (call,), finish = _call(client, model_name, stream, "required", tools=(strict,))
    assert finish == "tool_calls"
    _check(call, strict)
    assert set(json.loads(call[2])) == {"city"}


def test_strict_refuses_a_schema_open_to_other_keys(server, model_name):  # noqa: F811
    import httpx

    def tool(parameters, strict=True):
        return {"type": "function", "function": {"name": "f", "parameters": parameters, "strict": strict}}

    for tools, message in [
        ([tool({"type": "object", "properties": {}, "additionalProperties": True})],
         "tools[0].function.parameters allows keys it does not declare"),
        ([tool({"type": "object", "properties": {"a": {"type": "object", "additionalProperties": {"type": "string"}}}})],
         "tools[0].function.parameters.properties.a allows keys it does not declare"),
        ([tool({"type": "object"}, strict="yes")], "tools[0].function.strict must be true or false"),
    ]:
        r = httpx.post(f"{server}/v1/chat/completions", json={"model": model_name, "messages": QUESTION,
                                                               "tools": tools, "max_tokens": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        assert message in r.json()["error"]["message"], r.text
