"""`n` > 1 through `specrs serve` and the official `openai` client: one request, n choices, each
exactly what a request with seed + index gets alone (vLLM's seeds), streamed (chunks of every
choice interleaved, each naming its index) and not; the prompt counts once in the usage, the
completion tokens of every choice are summed; tool calls and logprobs per choice; a client that
leaves mid-stream ends every sample."""

from __future__ import annotations

import json
import time

import httpx
import pytest

import specrs
from test_serve import client, model_name, server  # noqa: F401 (fixtures)
from test_serve_tools import QUESTION, WEATHER

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Write one sentence about a lighthouse."}]


def _alone(engine, prompt, seed, max_tokens=24, **settings):
    return engine.generate(prompt, specrs.SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed,
                                                         **settings), speculative_config=False)


def test_chat_choices_are_each_seeded_request_alone(engine, client, model_name):  # noqa: F811
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, n=3, max_tokens=24,
                                         temperature=0.9, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.message.content for c in out.choices]
    for i, choice in enumerate(out.choices):
        alone = _alone(engine, MESSAGES, 5 + i)
        assert choice.message.content == alone.text and choice.finish_reason == alone.finish_reason
    assert len(set(texts)) > 1
    prompt_tokens = len(engine.prompt_token_ids(MESSAGES))
    total = sum(len(_alone(engine, MESSAGES, 5 + i).token_ids) for i in range(3))
    assert out.usage.prompt_tokens == prompt_tokens and out.usage.completion_tokens == total
    # The three samples' acceptance, summed (merged_metrics, tested below). How many drafts they
    # made depends on the server's load budget, which is timed: only consistency is certain.
    speculative = out.usage.model_extra["speculative"]
    assert speculative["method"] == "suffix"
    assert sum(speculative["num_accepted_tokens_per_pos"]) == speculative["num_accepted_tokens"]
    assert speculative["num_accepted_tokens"] <= speculative["num_draft_tokens"]


def test_merged_metrics_sum_the_samples_counts(engine):
    """A request's `speculative` usage over n samples: counts summed, rates recomputed from the sums."""
    from specrs.serve.protocol import merged_metrics

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    prompts = ["one two three four one two three four one two three", "a b c d e a b c d e a b c d"]
    samples = [engine.generate(p, specrs.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), speculative_config=ngram).metrics
               for p in prompts]
    assert all(m["num_drafts"] > 0 for m in samples)  # model-free drafts on repeated text, untimed
    merged = merged_metrics(samples)
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_idle_steps"):
        assert merged[key] == samples[0][key] + samples[1][key], key
    assert merged["idle_steps"] == {r: samples[0]["idle_steps"][r] + samples[1]["idle_steps"][r]
                                    for r in samples[0]["idle_steps"]}
    idlest = max(samples, key=lambda m: m["num_idle_steps"])
    assert merged["idle_reason"] == idlest["idle_reason"]
    assert merged["num_accepted_tokens_per_pos"] == [a + b for a, b in zip(samples[0]["num_accepted_tokens_per_pos"],
                                                                          samples[1]["num_accepted_tokens_per_pos"])]
    assert merged["acceptance_rate"] == pytest.approx(merged["num_accepted_tokens"] / merged["num_draft_tokens"])
    assert merged["mean_acceptance_length"] == pytest.approx(1 + merged["num_accepted_tokens"] / merged["num_drafts"])
    assert merged_metrics([samples[0], {}]) is samples[0] and merged_metrics([{}, {}]) is None


@pytest.mark.parametrize("stream", [False, True])
def test_completion_choices_with_logprobs(engine, client, model_name, stream):  # noqa: F811
    prompt = "The three most useful kitchen tools are"
    out = client.completions.create(model=model_name, prompt=prompt, n=2, max_tokens=16, temperature=0.9, seed=9,
                                    logprobs=2, stream=stream,
                                    **({"stream_options": {"include_usage": True}} if stream else {}))
    texts, tokens, finish, usage = {0: "", 1: ""}, {0: [], 1: []}, {}, None
    if stream:
        for chunk in out:
            if chunk.usage is not None and not chunk.choices:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                tokens[choice.index] += choice.logprobs.tokens if choice.logprobs else []
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
    else:
        usage = out.usage
        for choice in out.choices:
            texts[choice.index], tokens[choice.index] = choice.text, choice.logprobs.tokens
            finish[choice.index] = choice.finish_reason
    expected = [_alone(engine, prompt, 9 + i, max_tokens=16, logprobs=2) for i in range(2)]
    for i, alone in enumerate(expected):
        assert texts[i] == alone.text and finish[i] == alone.finish_reason
        assert len(tokens[i]) == len(alone.token_ids)
    assert usage.completion_tokens == sum(len(a.token_ids) for a in expected)


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_is_a_tool_call(client, model_name, stream):  # noqa: F811
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=model_name, messages=QUESTION, tools=[WEATHER], tool_choice=named,
                                         n=2, max_tokens=80, temperature=0.8, seed=1, stream=stream)
    calls: dict[int, dict] = {}
    finish: dict[int, str] = {}
    if stream:
        for chunk in out:
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(choice.index, {"name": "", "arguments": ""})
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
    else:
        for choice in out.choices:
            (call,) = choice.message.tool_calls
            calls[choice.index] = {"name": call.function.name, "arguments": call.function.arguments}
            finish[choice.index] = choice.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for call in calls.values():
        assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)


def test_leaving_mid_stream_ends_every_sample(server, model_name):  # noqa: F811
    body = {"model": model_name, "messages": MESSAGES, "n": 3, "max_tokens": 400, "temperature": 0.9,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as response:
        seen: set[int] = set()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"] if c["delta"].get("content"))
            if len(seen) == 3:
                break  # leave: the connection closes with the samples mid-answer
    assert seen == {0, 1, 2}
    deadline = time.time() + 30
    while True:
        health = httpx.get(f"{server}/health").json()
        if health["num_requests_running"] == 0 and health["num_requests_waiting"] == 0:
            break
        assert time.time() < deadline, health
        time.sleep(0.2)
