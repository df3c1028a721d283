"""`specrs serve` against the official `openai` client: a live server process on the real model.

The server starts with suffix decoding as its default and at most 4 requests generating at once
(batched into one forward per step), so 16 parallel requests also exercise the queue. Every greedy answer is checked against the same
request run in this process without the server.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import specrs

openai = pytest.importorskip("openai")

SERVER_SPEC = {"method": "suffix", "num_speculative_tokens": 4}
MAX_NUM_SEQS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PROMPTS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "List the days of the week.",
    "Write a haiku about autumn leaves.",
    "What is 12 times 12? Answer with a sentence.",
    "Translate to French: good morning, my friend.",
    "Name three primary colors.",
    "Explain in one sentence what a compiler does.",
    "Count from one to ten in words.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A loaded 2-core CI machine took over 120 s to start a server once.
SERVER_START_TIMEOUT_S = 300


@contextlib.contextmanager
def running_server(flags: list[str], log_path, env: dict | None = None):
    """`specrs serve FLAGS` on a free port in a subprocess, its output in `log_path` (a pipe nobody
    reads could fill up and block the server); yields its base URL once /health answers 200, and at
    the end stops it and checks that no request ended in an unhandled exception (uvicorn logs those
    as errors)."""
    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "specrs.cli", "serve", "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + SERVER_START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"specrs serve did not start:\n{log_path.read_text()}")
        time.sleep(0.2)
    try:
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert "Traceback" not in log_path.read_text(), log_path.read_text()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--max-num-seqs", str(MAX_NUM_SEQS), "--speculative-config", json.dumps(SERVER_SPEC), "--log-level",
             "warning"]
    with running_server(flags, tmp_path_factory.mktemp("serve") / "server.log") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def _local(engine, prompt: str, kind: str, max_tokens: int) -> str:
    messages = [{"role": "user", "content": prompt}] if kind == "chat" else prompt
    return engine.generate(messages, specrs.SamplingParams(temperature=0, max_tokens=max_tokens)).text


def _ask(client, model_name, kind: str, prompt: str, max_tokens: int, stream: bool, speculative=None, **extra):
    """(text, finish_reason, usage) from the server; `speculative` goes in extra_body when given."""
    body = {} if speculative is None else {"speculative": speculative}
    kwargs = dict(model=model_name, max_tokens=max_tokens, temperature=0, stream=stream, extra_body=body, **extra)
    if kind == "chat":
        out = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs)
    else:
        out = client.completions.create(prompt=prompt, **kwargs)
    if not stream:
        choice = out.choices[0]
        return (choice.message.content if kind == "chat" else choice.text), choice.finish_reason, out.usage
    texts, finish_reason, usage = [], None, None
    for chunk in out:
        if chunk.choices:
            piece = chunk.choices[0].delta.content if kind == "chat" else chunk.choices[0].text
            texts.append(piece or "")
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        usage = chunk.usage or usage
    return "".join(texts), finish_reason, usage


def _metric(base: str, name: str, **labels) -> float:
    """Sum of a Prometheus series' samples whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        m = re.match(r"^([\w:]+)(?:\{(.*)\})? ([-+\deE.naif]+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def test_models_and_health(server, client, model_name):
    assert model_name == "SmolLM2-135M-Instruct.Q4_1"
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["num_requests_waiting"] == 0


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("speculative", [None, NGRAM, False, {"num_speculative_tokens": 2}],
                         ids=["server-default", "ngram", "off", "default-k2"])
def test_greedy_answers_match_the_engine(engine, client, model_name, kind, stream, speculative):
    prompt = PROMPTS[0]
    text, finish_reason, usage = _ask(client, model_name, kind, prompt, 40, stream, speculative)
    assert text == _local(engine, prompt, kind, 40)
    assert finish_reason in ("stop", "length")
    assert usage.completion_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["speculative"]
    if speculative is False:
        assert spec is None
        return
    requested = SERVER_SPEC if speculative is None else {**SERVER_SPEC, **speculative}
    method, k = requested["method"], requested["num_speculative_tokens"]
    assert spec["method"] == method and spec["num_speculative_tokens"] == k
    assert len(spec["acceptance_rate_per_pos"]) == k
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / max(spec["num_drafts"], 1))
    assert 0 <= spec["acceptance_rate"] <= 1


def test_long_prompt_prefilled_in_chunks_matches_the_engine(engine, client, model_name):
    """The server feeds prompts 64 tokens per step; a 300-token prompt gives the same answer."""
    prompt = "Summarize the following notes in one sentence. " + " ".join(
        f"Note {i}: the shipment of item {i} arrived on day {i % 7}." for i in range(20))
    assert len(engine.prompt_token_ids([{"role": "user", "content": prompt}])) > 4 * 64
    for stream in (False, True):
        assert _ask(client, model_name, "chat", prompt, 24, stream)[0] == _local(engine, prompt, "chat", 24)


def test_repetitive_prompt_reports_acceptance(client, model_name):
    """The sentence to repeat is in the prompt, so ngram drafts and most drafts are accepted.
    Every draft is verified whole: how often the adaptive length drafts depends on this machine's
    measured verification cost, and this test is about what the server reports."""
    config = {**NGRAM, "adaptive_draft_length": False}
    text, _, usage = _ask(client, model_name, "chat", PROMPTS[0], 48, False, config)
    spec = usage.model_extra["speculative"]
    assert spec["num_drafts"] > 0 and spec["acceptance_rate"] > 0.5, spec
    assert spec["acceptance_rate_per_pos"][0] >= spec["acceptance_rate_per_pos"][-1]


def test_include_usage_chunk(client, model_name):
    chunks = list(client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-2].choices[0].finish_reason == "length"


def test_stop_strings(engine, client, model_name):
    full = _local(engine, PROMPTS[7], "chat", 40)
    stop = full.split()[2]  # a word from the middle of the answer
    expected = full[: full.index(stop)]
    for stream in (False, True):
        text, finish_reason, _ = _ask(client, model_name, "chat", PROMPTS[7], 40, stream, stop=[stop])
        assert (text, finish_reason) == (expected, "stop")


@pytest.mark.parametrize("speculative", [False, NGRAM, None], ids=["off", "ngram", "suffix"])
def test_seeded_sampling_is_reproducible(client, model_name, speculative):
    """Same seed, same tokens, whatever the drafts: with suffix decoding a repeated request drafts
    from a cache that now holds its first answer, and one-hot drafts are verified in coupled form
    (verify.rs), so the sampled tokens do not depend on them."""
    def sample(seed):
        return client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=24,
                                         temperature=0.9, seed=seed,
                                         extra_body={"speculative": speculative}).choices[0].text
    assert sample(7) == sample(7) != sample(8)


LAYER_SKIP = {"method": "layer_skip", "exit_layer": 20, "num_speculative_tokens": 3}


def _ask_streaming(client, model_name, prompt: str, max_tokens: int, speculative, seed: int | None) -> str:
    """A streamed chat answer: greedy, or sampled with `seed`."""
    body = {} if speculative is None else {"speculative": speculative}
    sampling = {"temperature": 0} if seed is None else {"temperature": 0.8, "top_p": 0.95, "seed": seed}
    out = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=max_tokens, stream=True, extra_body=body, **sampling)
    return "".join(chunk.choices[0].delta.content or "" for chunk in out if chunk.choices)


def test_parallel_streams_match_serving_alone(engine, server, client, model_name):
    """16 streaming requests at once (4 generate per batched step, the rest queue), with mixed
    methods (the server's suffix default, ngram, off, a layer-skip draft model), prompts of a few
    words to a few hundred tokens, greedy and seeded sampling: each answer is exactly the answer it
    gets alone, and the server answers health checks and metrics meanwhile."""
    methods = [None, NGRAM, False, LAYER_SKIP]
    jobs = [(PROMPTS[i % len(PROMPTS)] * (20 if i % 5 == 4 else 1), methods[i % 4], 100 + i if i % 3 == 1 else None)
            for i in range(16)]
    max_tokens = 40
    results: dict[int, str] = {}
    errors = []

    def run(i, prompt, speculative, seed):
        try:
            results[i] = _ask_streaming(client, model_name, prompt, max_tokens, speculative, seed)
        except Exception as e:  # reported below; a thread's exception would be lost
            errors.append(repr(e))

    steps_before = _metric(server, "specrs:scheduler_steps_total")
    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    seen_waiting, num_health_answers = 0, 0
    while any(t.is_alive() for t in threads):
        health = httpx.get(f"{server}/health", timeout=10).json()
        num_health_answers += 1
        seen_waiting = max(seen_waiting, health["num_requests_waiting"])
        assert health["num_requests_running"] <= MAX_NUM_SEQS
        assert _metric(server, "specrs:num_requests_running") <= MAX_NUM_SEQS
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen_waiting > 0, "16 requests with --max-num-seqs 4 should queue"
    # /health answers while 16 streams generate (the event loop is never held by a step); how fast
    # it answers is the machine's business, not this test's.
    assert num_health_answers >= 2, "health was not answered while the requests generated"
    batched_steps = _metric(server, "specrs:scheduler_steps_total") - steps_before
    for i, (prompt, speculative, seed) in enumerate(jobs):
        alone = _ask_streaming(client, model_name, prompt, max_tokens, speculative, seed)
        assert results[i] == alone, f"request {i} differs when served in parallel"
        if seed is None:
            assert alone == _local(engine, prompt, "chat", max_tokens)
    # The 16 requests shared forwards: far fewer steps than their tokens (>= 16 * 40 alone, minus
    # early ends) would take one by one.
    assert 0 < batched_steps < 16 * max_tokens / 2, batched_steps


def _wait_idle(server: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while _metric(server, "specrs:num_requests_running") or _metric(server, "specrs:num_requests_waiting"):
        assert time.time() < deadline, "the server kept generating after its client went away"
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_generation(server, client, model_name, stream):
    _wait_idle(server)
    aborted = _metric(server, "specrs:request_success_total", finished_reason="abort")
    generated = _metric(server, "specrs:generation_tokens_total")
    # Long enough that no machine finishes it within the 2 s the unstreamed client waits (the
    # model's context is 8192 tokens).
    max_tokens = 8000
    body = {"model": model_name, "prompt": "Tell me a very long story.", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(5):
                next(lines)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/completions", json=body, timeout=2)
    _wait_idle(server)
    assert _metric(server, "specrs:request_success_total", finished_reason="abort") == aborted + 1
    assert _metric(server, "specrs:generation_tokens_total") - generated < max_tokens
    assert _ask(client, model_name, "completion", "Hello", 4, False)[1] == "length"  # still serving


def _error(server: str, path: str, body, status: int) -> dict:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    response = httpx.post(f"{server}{path}", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    return error


def test_bad_requests(server, client, model_name):
    chat = "/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    assert "not valid JSON" in _error(server, chat, b"{not json", 400)["message"]
    error = _error(server, chat, {"model": model_name, "messages": messages,
                                  "speculative": {"method": "ngram", "num_speculative_tokns": 4}}, 400)
    assert "num_speculative_tokns" in error["message"] and error["param"] == "speculative"
    assert "method" in _error(server, chat, {"messages": messages, "speculative": {"method": "medusa2"}}, 400)["message"]
    error = _error(server, "/v1/completions", {"model": model_name, "prompt": "word " * 9000, "max_tokens": 10}, 400)
    assert error["code"] == "context_length_exceeded" and "8192" in error["message"]
    assert _error(server, chat, {"messages": messages, "max_tokens": -5}, 400)["param"] == "max_tokens"
    assert _error(server, chat, {"model": "gpt-5", "messages": messages}, 404)["code"] == "model_not_found"
    assert _error(server, chat, {"messages": messages, "n": 0}, 400)["param"] == "n"
    assert _error(server, chat, {"messages": messages, "n": 129}, 400)["param"] == "n"
    assert _error(server, "/v1/completions", {"prompt": "hi", "best_of": 2}, 400)["param"] == "best_of"
    assert "frobnicate" in _error(server, chat, {"messages": messages, "frobnicate": 1}, 400)["message"]
    assert _error(server, chat, {"messages": messages, "temperature": -1}, 400)["message"]
    assert _error(server, chat, {"messages": []}, 400)["param"] == "messages"
    error = _error(server, chat, {"messages": messages, "speculative": {"method": "draft_model", "model": "/etc/passwd", "num_speculative_tokens": 2}}, 400)
    assert "only at startup" in error["message"]
    error = _error(server, chat, {"messages": messages, "speculative": {"method": "layer_skip", "exit_layer": 99, "num_speculative_tokens": 2}}, 400)
    assert "exit_layer" in error["message"]
    assert httpx.get(f"{server}/v1/nothing-here").status_code == 404
    assert httpx.get(f"{server}/v1/nothing-here").json()["error"]["code"] == "not_found"
    # The official client raises its own error classes for these statuses.
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=messages, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=4,
                                       extra_body={"speculative": {"method": "ngram", "bogus": 1}})
    assert _ask(client, model_name, "chat", "hi", 4, False)[1] in ("stop", "length")  # still serving


def test_metrics_exposition(server, client, model_name):
    # A fixed length: the counts below must not hang on a measured cost curve.
    _ask(client, model_name, "chat", PROMPTS[0], 32, False, {**NGRAM, "adaptive_draft_length": False})
    text = httpx.get(f"{server}/metrics").text
    for series in ("specrs:spec_decode_num_drafts_total", "specrs:spec_decode_num_draft_tokens_total",
                   "specrs:spec_decode_num_accepted_tokens_total", "specrs:spec_decode_num_accepted_tokens_per_pos_total",
                   "specrs:time_to_first_token_seconds_bucket", "specrs:inter_token_latency_seconds_bucket",
                   "specrs:e2e_request_latency_seconds_count", "specrs:num_requests_waiting",
                   "specrs:scheduler_steps_total", "specrs:scheduler_draft_tokens_wanted_total",
                   "specrs:scheduler_draft_tokens_granted_total", "specrs:scheduler_draft_tokens_accepted_total",
                   "specrs:num_preemptions_total", "specrs:scheduler_batch_size_bucket"):
        assert series in text, series
    assert _metric(server, "specrs:spec_decode_num_drafts_total", method="ngram") > 0
    accepted = _metric(server, "specrs:spec_decode_num_accepted_tokens_total", method="ngram")
    per_pos = [_metric(server, "specrs:spec_decode_num_accepted_tokens_per_pos_total", method="ngram", position=str(i))
               for i in range(4)]
    assert accepted == sum(per_pos) > 0 and per_pos == sorted(per_pos, reverse=True)
    wanted = _metric(server, "specrs:scheduler_draft_tokens_wanted_total")
    granted = _metric(server, "specrs:scheduler_draft_tokens_granted_total")
    verified = _metric(server, "specrs:scheduler_draft_tokens_verified_total")
    assert wanted >= granted >= verified > 0
    assert _metric(server, "specrs:scheduler_draft_tokens_accepted_total") <= verified


def test_a_server_overlapping_its_steps_answers_as_the_engine(engine):
    """With `overlap` on (what a CUDA target turns on), each step's outputs go out while the next
    step runs, and requests submitted meanwhile are added between a step's launch and its finish:
    concurrent answers, streamed and not, are each the engine's alone; the loop sent every step's
    report, and spent time between launches and finishes."""
    from starlette.testclient import TestClient

    from specrs.serve import build_app

    app = build_app(engine, "m", max_num_seqs=MAX_NUM_SEQS)
    app.state.scheduler.overlap = True
    answers: dict[int, str] = {}
    errors = []

    def ask(http, i):
        body = {"model": "m", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 20 + 4 * i, "temperature": 0,
                "speculative": NGRAM if i % 2 else SERVER_SPEC}
        try:
            if i % 3 == 0:
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    chunks = [json.loads(line[6:]) for line in response.iter_lines()
                              if line.startswith("data: ") and line != "data: [DONE]"]
                answers[i] = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            else:
                answers[i] = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        except Exception as e:  # reported below; a thread's exception would be lost
            errors.append(repr(e))

    with TestClient(app) as http:
        threads = [threading.Thread(target=ask, args=(http, i)) for i in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.05)  # arrivals spread over the first steps
        for t in threads:
            t.join()
        metrics = http.get("/metrics").text
    assert not errors, errors
    for i in range(6):
        params = specrs.SamplingParams(temperature=0, max_tokens=20 + 4 * i)
        assert answers[i] == engine.generate(PROMPTS[i % len(PROMPTS)], params).text, f"request {i}"
    overlapped = [line for line in metrics.splitlines()
                  if line.startswith("specrs:scheduler_overlapped_host_seconds_total")]
    assert overlapped and float(overlapped[0].split()[-1]) > 0, overlapped


def test_build_app_serves_a_custom_python_proposer(engine):
    """An Engine holding a Python proposer, served in process: requests use it by default."""
    from starlette.testclient import TestClient

    from specrs.serve import build_app

    class RepeatLast:
        def __init__(self):
            self.calls = 0

        def propose(self, context_ids, max_tokens):
            self.calls += 1
            return [context_ids[-1]] * max_tokens

    proposer = RepeatLast()
    custom = specrs.Engine(proposer=proposer)
    with TestClient(build_app(custom, "custom-model", max_num_seqs=2)) as http:
        body = {"model": "custom-model", "prompt": "One, two, three,", "max_tokens": 16, "temperature": 0}
        out = http.post("/v1/completions", json=body).json()
        assert out["choices"][0]["text"] == engine.generate("One, two, three,", specrs.SamplingParams(temperature=0, max_tokens=16)).text
        assert out["usage"]["speculative"]["method"] == "custom" and proposer.calls > 0
        off = http.post("/v1/completions", json={**body, "speculative": False}).json()
        assert off["choices"][0]["text"] == out["choices"][0]["text"] and off["usage"]["speculative"] is None


def test_a_paged_server_answers_parallel_streams_as_the_engine(engine, tmp_path):
    """`--kv-layout paged`: one pool of --max-kv-tokens positions, budgeted by the scheduler in
    blocks. 8 streams that together outgrow the pool (8 blocks of 16: a request takes 3 to start
    and up to 6, so any two that overlap outgrow it) are each answered as the engine answers alone
    (some preempted and recomputed, none failed for want of a block)."""
    flags = ["--kv-layout", "paged", "--kv-block-size", "16", "--max-kv-tokens", "128", "--max-num-seqs", "8",
             "--speculative-config", json.dumps(NGRAM), "--log-level", "warning"]
    with running_server(flags, tmp_path / "server.log") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
        results: dict[int, str] = {}
        errors = []

        def run(i):
            try:
                results[i] = _ask_streaming(client, name, prompts[i], 40, None, None)
            except Exception as e:  # reported below; a thread's exception would be lost
                errors.append(repr(e))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert _metric(base, "specrs:num_preemptions_total") > 0, "8 streams fit 128 positions: nothing preempted"
    for i, prompt in enumerate(prompts):
        assert results[i] == _local(engine, prompt, "chat", 40), f"stream {i}"
