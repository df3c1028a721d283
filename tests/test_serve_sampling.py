"""vLLM's sampling fields through `specrs serve` and the official `openai` client (the server of
test_serve.py: suffix decoding by default): `stop` with `include_stop_str_in_output` and vLLM's
`stop_reason`, streamed and not; `skip_special_tokens`, `spaces_between_special_tokens`,
`truncate_prompt_tokens`, `bad_words`, `allowed_token_ids` in `extra_body`, each answer exactly the
engine's for the same settings; bad values are 400s naming the field."""

from __future__ import annotations

import json

import pytest

import specrs
from test_serve import client, model_name, server  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")

PROMPT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat sat"
MAX_TOKENS = 32


def _local(engine, prompt=PROMPT, **settings):
    return engine.generate(prompt, specrs.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **settings),
                           speculative_config=False)


def _complete(client, model_name, stream: bool, prompt=PROMPT, **settings):  # noqa: F811
    """(text, finish_reason, stop_reason, usage) of a greedy completion; `settings` are vLLM's
    fields (extra_body) or OpenAI's (stop)."""
    stop = settings.pop("stop", None)
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    stop=stop, stream=stream, extra_body=settings)
    if not stream:
        choice = out.choices[0]
        return choice.text, choice.finish_reason, choice.model_extra["stop_reason"], out.usage
    texts, finish_reason, stop_reason = [], None, None
    for chunk in out:
        choice = chunk.choices[0]
        texts.append(choice.text)
        if choice.finish_reason is not None:
            finish_reason, stop_reason = choice.finish_reason, choice.model_extra["stop_reason"]
    return "".join(texts), finish_reason, stop_reason, None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_with_include_and_stop_reason(engine, client, model_name, stream, include):  # noqa: F811
    full = _local(engine, ignore_eos=True).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected = _local(engine, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
    assert expected.text == full[:full.index(stop) + (len(stop) if include else 0)]
    got = _complete(client, model_name, stream, stop=[stop], ignore_eos=True, include_stop_str_in_output=include)
    assert got[:3] == (expected.text, "stop", stop)


def test_chat_reports_the_stop_reason(engine, client, model_name):  # noqa: F811
    messages = [{"role": "user", "content": "List the days of the week."}]
    full = _local(engine, messages).text
    stop = full.split()[2]
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                         stop=stop)
    choice = out.choices[0]
    assert (choice.message.content, choice.finish_reason) == (full[:full.index(stop)], "stop")
    assert choice.model_extra["stop_reason"] == stop
    ended = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0)
    assert ended.choices[0].finish_reason == "length" and ended.choices[0].model_extra["stop_reason"] is None


CHAT = [{"role": "user", "content": "Count from one to twenty in words, separated by commas."}]
FIELDS = ["skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "bad_words",
          "allowed_token_ids"]


def _case(engine, field: str) -> tuple[list[int], dict]:
    """(prompt token ids, vLLM settings) for `field`; `test_the_fields_change_the_answer` checks
    that each setting changes the engine's answer."""
    if field in ("skip_special_tokens", "spaces_between_special_tokens"):
        # A chat prompt as token ids: past EOS (ignore_eos) the model writes the template's tokens.
        settings = {"skip_special_tokens": False, "ignore_eos": True}
        if field == "spaces_between_special_tokens":
            settings["spaces_between_special_tokens"] = False
        return engine.prompt_token_ids(CHAT), settings
    prompt = engine.prompt_token_ids(PROMPT)
    if field == "truncate_prompt_tokens":
        return prompt, {"truncate_prompt_tokens": 10}
    if field == "bad_words":
        return prompt, {"bad_words": ["cat", "on the"], "ignore_eos": True}
    return prompt, {"allowed_token_ids": sorted(set(_local(engine, prompt).token_ids[:5]))}


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_fields_answer_as_the_engine(engine, client, model_name, field, stream):  # noqa: F811
    prompt, settings = _case(engine, field)
    expected = _local(engine, prompt, **settings)
    text, finish_reason, _, usage = _complete(client, model_name, stream, prompt, **settings)
    assert (text, finish_reason) == (expected.text, expected.finish_reason)
    if usage is not None:
        assert usage.prompt_tokens == len(expected.prompt_token_ids)
        assert usage.completion_tokens == len(expected.token_ids)


@pytest.mark.parametrize("field", FIELDS[2:])
def test_the_fields_change_the_answer(engine, field):
    """The settings of the test above change the engine's answer on these prompts, so that test
    could not pass by ignoring them (special tokens: checked just below)."""
    prompt, settings = _case(engine, field)
    without = {k: v for k, v in settings.items() if k == "ignore_eos"}
    assert _local(engine, prompt, **settings).token_ids != _local(engine, prompt, **without).token_ids


def test_special_tokens_are_written_when_not_skipped(engine):
    prompt, settings = _case(engine, "skip_special_tokens")
    assert "<|im_end|>" in _local(engine, prompt, **settings).text
    assert "<|im_end|>" not in _local(engine, prompt, ignore_eos=True).text


@pytest.mark.parametrize("field, value", [
    ("include_stop_str_in_output", "yes"), ("skip_special_tokens", 1), ("spaces_between_special_tokens", None),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -5), ("bad_words", "cat"), ("bad_words", [" "]),
    ("allowed_token_ids", []), ("allowed_token_ids", [10**6]), ("allowed_token_ids", "1"), ("stop", [""]),
    ("prompt_logprobs", 1),
])
def test_bad_values_are_400s_naming_the_field(client, model_name, field, value):  # noqa: F811
    if value is None:  # null is the default; a list is not a bool
        value = [True]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=4, extra_body={field: value})
    error = info.value.body
    assert error["param"] == field, error
    assert field in error["message"] or field == "stop", error


def _sse_completion(body: str) -> tuple[str, str | None]:
    """(text, stop_reason) of a streamed completion's server-sent events."""
    chunks = [json.loads(line[len("data: "):]) for line in body.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [chunk["choices"][0] for chunk in chunks if chunk.get("choices")]
    finished = [choice for choice in choices if choice.get("finish_reason") is not None]
    return "".join(choice["text"] for choice in choices), finished[-1]["stop_reason"]


def test_the_servers_suffix_cache_learns_only_the_emitted_tokens(engine, model_path):
    """A stop string ends the request in the core, so the server's suffix cache (what the next
    requests draft from) holds exactly the tokens the client got, streamed or not, also when the
    stop string completed inside an accepted draft: the server once aborted the request after the
    step that showed the stop string, and the cache learned that step's tokens past it."""
    from starlette.testclient import TestClient

    from specrs.serve import build_app

    config = {"method": "suffix", "num_speculative_tokens": 6, "adaptive_draft_length": False}
    serving = specrs.Engine(model_path, speculative_config=config)
    # The same requests in the same order on an engine of its own, whose suffix cache hence drafts
    # as the server's does: its metrics show where a stop string completed inside a draft.
    mirror = specrs.Engine(model_path, speculative_config=config)
    full = _local(engine, ignore_eos=True).text
    stops = [full[start:start + 4] for start in (30, 34, 38, 45, 52)]
    num_cut_inside_a_draft = 0
    # draft_budget "off": every draft as proposed, as Engine.generate runs it (no batch to share rows with).
    with TestClient(build_app(serving, "m", draft_budget="off")) as http:
        for i, stop in enumerate(stops):
            expected = mirror.generate(PROMPT, specrs.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop],
                                                                     ignore_eos=True))
            assert expected.text == full[:full.index(stop)]
            m = expected.metrics
            num_cut_inside_a_draft += m["num_generated_tokens"] < 1 + m["num_decode_steps"] + m["num_accepted_tokens"]
            stream = i % 2 == 1
            response = http.post("/v1/completions", json={
                "model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [stop],
                "ignore_eos": True, "stream": stream})
            assert response.status_code == 200, response.text
            if stream:
                assert _sse_completion(response.text) == (expected.text, stop)
            else:
                choice, usage = response.json()["choices"][0], response.json()["usage"]
                assert (choice["text"], choice["stop_reason"]) == (expected.text, stop)
                assert usage["completion_tokens"] == len(expected.token_ids)
            [(_, responses)] = serving.suffix_cache_responses()
            assert len(responses) == i + 1 and responses[-1] == expected.token_ids, stop
    assert num_cut_inside_a_draft > 0
