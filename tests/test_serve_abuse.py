"""No request can stall or kill `specrs serve` (issue 16, "Hardening"): one bad request costs one 400
(or one 500 for an internal fault), never the other streams.

A live uvicorn server runs in a thread of this process, serving an engine whose custom proposer is
the test-only panicking one (`_specrs._testing_panicking_proposer`: a real Rust panic inside
`Session::step`), so a request can inject a panic by asking for `"method": "custom"`. Every good
stream is compared with the same request run alone on the session's engine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import subprocess
import sys
import textwrap
import threading

import httpx
import pytest

import specrs
from specrs import ConfigError, SamplingParams, SpecrsError, _specrs
from specrs.engine import _config_json

uvicorn = pytest.importorskip("uvicorn")
from specrs.serve import build_app, uvicorn_settings  # noqa: E402  (needs the serve extra, checked above)

MODEL = "abuse-model"
SERVER_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# The panicking proposer's third propose() call panics; every draft is verified (no adaptive length,
# which might skip drafting and so never call it).
PANICS_AFTER_CALLS = 2
PANIC = {"method": "custom", "num_speculative_tokens": 2, "adaptive_draft_length": False}
BODY_LIMIT = 64 * 1024
DEFAULT_MAX_TOKENS = 8
GOOD_PROMPT = "Count from one to twenty in words, separated by commas."
GOOD_MAX_TOKENS = 160


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Errors(logging.Handler):
    """uvicorn's error log (an unhandled exception in a handler shows up there)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(self.format(record))


@contextlib.contextmanager
def serve_in_thread(app, **limits):
    """`app` on a free port in a thread of this process, with `specrs serve`'s uvicorn settings
    (`limits`: its connection limits, else serve's defaults); yields (base URL, port, the uvicorn
    error log). At the end nothing may be in that log: an unhandled exception in a handler shows up
    there."""
    port = _free_port()
    config = uvicorn.Config(app, **uvicorn_settings("127.0.0.1", port, "warning", **limits))
    errors = _Errors()  # after the Config: it (re)configures uvicorn's loggers
    logging.getLogger("uvicorn.error").addHandler(errors)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            pytest.fail("the test server did not start")
        threading.Event().wait(0.05)
    try:
        yield f"http://127.0.0.1:{port}", port, errors
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        logging.getLogger("uvicorn.error").removeHandler(errors)
    assert not errors.records, "\n".join(errors.records)


@pytest.fixture(scope="module")
def live():
    engine = specrs.Engine(speculative_config=SERVER_SPEC,
                           proposer=_specrs._testing_panicking_proposer(PANICS_AFTER_CALLS))
    # No load budget: it is timed, and it could grant the panicking request no draft (so no call)
    # while another request streams beside it.
    app = build_app(engine, MODEL, max_num_seqs=4, max_request_body_bytes=BODY_LIMIT,
                    default_max_tokens=DEFAULT_MAX_TOKENS, draft_budget="off")
    with serve_in_thread(app) as (base, port, errors):
        yield type("Live", (), {"base": base, "port": port, "engine": engine, "app": app, "errors": errors})()


def _metric(base: str, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        m = re.match(r"^([\w:]+)(?:\{(.*)\})? ([-+\deE.naif]+)$", line)
        if m and m.group(1) == name:
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
    return total


def _post(base: str, path: str, body, **kwargs) -> httpx.Response:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{base}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=120,
                      **kwargs)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"], error
    return error


def _chat_body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


class GoodStream:
    """A greedy streaming chat request read in a thread; `first_chunk` is set once it is flowing."""

    def __init__(self, base: str, prompt: str = GOOD_PROMPT, max_tokens: int = GOOD_MAX_TOKENS, speculative=None):
        self.body = _chat_body(prompt, max_tokens, stream=True, speculative=speculative)
        self.base, self.texts, self.error = base, [], None
        self.finish_reason = None
        self.first_chunk = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        try:
            with httpx.stream("POST", f"{self.base}/v1/chat/completions", json=self.body, timeout=300) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    assert "error" not in chunk, chunk
                    if chunk["choices"]:
                        self.texts.append(chunk["choices"][0]["delta"].get("content") or "")
                        self.finish_reason = chunk["choices"][0]["finish_reason"] or self.finish_reason
                        self.first_chunk.set()
        except BaseException as e:  # reported by `text()`
            self.error = e
        finally:
            self.first_chunk.set()

    def text(self) -> str:
        self.thread.join()
        assert self.error is None, repr(self.error)
        return "".join(self.texts)


def _alone(engine, prompt: str = GOOD_PROMPT, max_tokens: int = GOOD_MAX_TOKENS) -> str:
    return engine.generate([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens),
                           speculative_config=False).text


# ---------------------------------------------------------------------------------------------
# The Python API: a panic inside a step, or in a proposer hook, never reaches Python as a panic.


def _panicking_stream(engine, hook: str, after_calls: int = 1, max_tokens: int = 32):
    return engine.stream("Once upon a time", SamplingParams(temperature=0, max_tokens=max_tokens),
                         speculative_config=PANIC, proposer=_specrs._testing_panicking_proposer(after_calls, hook))


@pytest.mark.parametrize("hook", ["propose", "observe"])
def test_a_panic_inside_a_step_ends_the_stream_and_the_stream_still_answers(engine, hook):
    kv_before = engine.memory()["target_kv_bytes"]
    stream = _panicking_stream(engine, hook)
    with pytest.raises(SpecrsError, match="testing panic"):
        for _ in range(40):
            stream.step()
    # No further step on the half-updated session; everything else still answers.
    assert stream.finished
    result = stream.result
    assert result.finish_reason == "error" and len(result.token_ids) >= 1
    assert stream.kv_lens() == (0, None), "the failed request's KV cache is freed"
    assert engine.memory()["target_kv_bytes"] == kv_before
    stream.cancel()
    with pytest.raises(SpecrsError, match="already ended with an error"):
        stream.step()
    with pytest.raises(SpecrsError, match="already ended with an error"):
        next(iter(stream))
    # The engine is unharmed: the same request without the panic gives plain greedy output.
    ids = engine.prompt_token_ids("Once upon a time")
    assert engine.generate(ids, SamplingParams(temperature=0, max_tokens=8), speculative_config=False).token_ids == \
        engine.generate(ids, SamplingParams(temperature=0, max_tokens=8), speculative_config=SERVER_SPEC).token_ids


def test_a_panic_in_cancel_or_kv_lens_is_a_specrs_error(engine):
    stream = _panicking_stream(engine, "finish", after_calls=0)
    stream.step()
    with pytest.raises(SpecrsError, match="testing panic"):
        stream.cancel()  # cancel runs the proposer's finish hook, which panics
    assert stream.finished and stream.result.finish_reason == "error"
    stream.cancel()  # a second cancel is a no-op

    stream = _panicking_stream(engine, "kv_len", after_calls=0)
    with pytest.raises(SpecrsError, match="testing panic"):
        stream.kv_lens()
    assert not stream.finished  # kv_lens only reads; the request itself is fine
    stream.cancel()
    assert stream.result.finish_reason == "abort"


def test_the_testing_proposer_names_its_hooks():
    with pytest.raises(ConfigError, match="propose, observe, finish, kv_len"):
        _specrs._testing_panicking_proposer(1, "verify")


def test_stream_methods_release_the_gil_before_taking_the_session_lock(model_path):
    """A step holds the session lock while its Python proposer runs (which needs the GIL); a
    `cancel()` or `finished` from another thread that kept the GIL while waiting for the lock would
    deadlock. Run in a subprocess so a deadlock fails the test instead of hanging the suite."""
    script = textwrap.dedent(f"""
        import threading, specrs
        in_propose, release = threading.Event(), threading.Event()

        class Blocking:
            def propose(self, context_ids, max_tokens):
                in_propose.set()
                release.wait()  # until another Python thread runs, which needs the GIL
                return [context_ids[-1]] * max_tokens

        engine = specrs.Engine({model_path!r})
        stream = engine.stream("Hello there", specrs.SamplingParams(temperature=0, max_tokens=16), proposer=Blocking(),
                               speculative_config={{"method": "custom", "num_speculative_tokens": 2,
                                                    "adaptive_draft_length": False}})
        stream.step()  # the prefill step: no draft
        stepper = threading.Thread(target=stream.step)
        stepper.start()
        in_propose.wait()
        threading.Timer(0.2, release.set).start()
        stream.cancel()   # waits for the step's lock with the GIL released
        stepper.join()
        assert stream.finished and stream.result.finish_reason == "abort"
        print("no deadlock")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "no deadlock" in out.stdout, out.stderr


@pytest.mark.parametrize("kwargs, field", [
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"max_tokens": 2**100}, "max_tokens"),
    ({"temperature": 10**400}, "temperature"),
    ({"top_p": -(10**400)}, "top_p"),
])
def test_oversized_numbers_are_config_errors(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kwargs)


def test_largest_valid_numbers_are_accepted():
    params = SamplingParams(seed=2**64 - 1, top_k=2**63 - 1)
    assert (params.seed, params.top_k) == (2**64 - 1, 2**63 - 1)
    assert SamplingParams().max_tokens == 16 and SamplingParams(seed=None).seed is None
    with pytest.raises(TypeError):
        SamplingParams(max_tokens="many")


def test_oversized_prompt_token_ids_are_config_errors(engine):
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.generate([1, 2**40], SamplingParams(max_tokens=2))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.stream([-1], SamplingParams(max_tokens=2))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.tokenizer.decode([2**33])


# ---------------------------------------------------------------------------------------------
# The live server.


def test_a_panic_in_one_request_ends_it_alone(live):
    """A Rust panic injected into two requests' steps (one streamed, one not) while another request
    streams: the panicking ones end with OpenAI's 500 error body (as an error event once a stream
    has started) and finished_reason="error"; the other stream's output is what it is alone."""
    errors_before = _metric(live.base, "specrs:request_success_total", finished_reason="error")
    good = GoodStream(live.base)
    good.first_chunk.wait()
    error = _error(_post(live.base, "/v1/chat/completions", _chat_body("Hi!", 32, speculative=PANIC,
                                                                         ignore_eos=True)), 500)
    assert "testing panic" in error["message"] and error["type"] == "internal_error"
    with httpx.stream("POST", f"{live.base}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0,
                            "ignore_eos": True, "stream": True, "speculative": PANIC}) as response:
        assert response.status_code == 200  # the status went out with the first chunk
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "testing panic" in json.loads(events[-2])["error"]["message"]
    assert good.text() == _alone(live.engine) and good.finish_reason in ("stop", "length")
    assert _metric(live.base, "specrs:request_success_total", finished_reason="error") == errors_before + 2
    assert httpx.get(f"{live.base}/health").json()["status"] == "ok"
    ok = _post(live.base, "/v1/chat/completions", _chat_body(GOOD_PROMPT, 16, speculative=False)).json()
    assert ok["choices"][0]["message"]["content"] == _alone(live.engine, max_tokens=16)


def test_abusive_speculative_configs_are_400s_while_a_stream_runs(live):
    """Configs whose proposer would allocate per unit of a huge bound (an n-gram table per length
    up to 10^8, a suffix tree 10^8 deep) are refused by the config's own validation."""
    abusive = [
        {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 100000000, "num_speculative_tokens": 4},
        {"method": "suffix", "suffix_decoding_max_tree_depth": 100000000},
        {"method": "ngram", "num_speculative_tokens": 10**30},
    ]
    for config in abusive:  # checked here first, so a missing bound fails without allocating anything
        with pytest.raises(ConfigError):
            _config_json(config)
    good = GoodStream(live.base)
    good.first_chunk.wait()
    for config in abusive:
        error = _error(_post(live.base, "/v1/chat/completions", _chat_body("Hi", 8, speculative=config)), 400)
        assert error["param"] == "speculative", error
    assert good.text() == _alone(live.engine)


def test_oversized_bodies_are_413s(live):
    big = json.dumps(_chat_body("word " * (BODY_LIMIT // 4), 4)).encode()
    assert len(big) > BODY_LIMIT
    error = _error(_post(live.base, "/v1/chat/completions", big), 413)
    assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"]

    def chunked():  # no Content-Length: the limit applies to the bytes as they arrive
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    response = httpx.post(f"{live.base}/v1/completions", content=chunked(), timeout=60,
                          headers={"Content-Type": "application/json"})
    assert _error(response, 413)["code"] == "request_too_large"
    # Under the limit, the body is read and judged on its content.
    under = _chat_body("word " * (BODY_LIMIT // 8), 4)
    assert _error(_post(live.base, "/v1/chat/completions", under), 400)["code"] == "context_length_exceeded"
    assert httpx.get(f"{live.base}/health").status_code == 200


def test_a_client_gone_mid_body_is_not_an_error(live):
    """A client that closes its connection half way through sending its body is nobody's error:
    no 500, nothing in the error log (reading the body raised out of the handler before)."""
    errors_before = len(live.errors.records)
    with socket.create_connection(("127.0.0.1", live.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": \"Hel")
    # A full request after it: by the time it is answered, the server has long read the EOF.
    ok = _post(live.base, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200
    assert live.errors.records[errors_before:] == []


def test_overflowing_numbers_are_400s(live):
    chat = "/v1/chat/completions"
    base = json.dumps(_chat_body("Hi", 4))[:-1]  # the body without its closing brace

    def with_field(raw_field: str) -> str:
        return base + ", " + raw_field + "}"

    cases = [
        (with_field(f'"seed": {2**64}'), "seed", "18446744073709551615"),
        (with_field('"seed": -1'), "seed", "0..="),
        (with_field(f'"top_k": {2**63}'), "top_k", str(2**63 - 1)),
        (with_field('"top_k": -2'), "top_k", "-1"),
        (with_field('"temperature": 1' + "0" * 400), "temperature", "finite"),
        (with_field('"top_p": 1e999'), "top_p", "finite"),
        (with_field('"min_p": NaN'), "min_p", "finite"),
        (with_field(f'"max_tokens": {2**70}'), "max_tokens", "maximum context length"),
    ]
    for raw, param, words in cases:
        error = _error(_post(live.base, chat, raw), 400)
        assert error["param"] == param and words in error["message"], (raw[-60:], error)
    error = _error(_post(live.base, "/v1/completions", {"model": MODEL, "prompt": [1, 2**40], "max_tokens": 2}), 400)
    assert error["param"] == "prompt" and "outside the vocabulary" in error["message"]
    vocab = live.engine.tokenizer.vocab_size
    assert _error(_post(live.base, "/v1/completions", {"prompt": [vocab], "max_tokens": 2}), 400)["param"] == "prompt"
    # Malformed JSON that trips Python's own limits: an integer literal of 5000 digits, deep nesting.
    assert "not valid JSON" in _error(_post(live.base, chat, with_field('"seed": ' + "9" * 5000)), 400)["message"]
    assert "too deeply" in _error(_post(live.base, chat, "[" * 20000 + "]" * 20000), 400)["message"]
    assert httpx.get(f"{live.base}/health").json()["status"] == "ok"


def test_continuous_usage_stats(live):
    body = _chat_body("Name three colors.", 12, stream=True, ignore_eos=True,
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = []
    with httpx.stream("POST", f"{live.base}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    assert all(chunk.get("usage") for chunk in chunks), "every chunk carries the usage so far"
    completion = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert completion[0] == 0 and completion == sorted(completion) and completion[-1] == 12
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert all(c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"] for c in chunks)
    error = _error(_post(live.base, "/v1/chat/completions",
                         {**body, "stream_options": {"continuous_usage_stats": True}}), 400)
    assert error["param"] == "stream_options" and "include_usage" in error["message"]


def test_chat_without_max_tokens_is_capped_by_the_server_default(live):
    out = _post(live.base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}],
                                                   "temperature": 0, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert out["choices"][0]["finish_reason"] == "length"
    # An explicit max_tokens may still go past the default.
    out = _post(live.base, "/v1/chat/completions", _chat_body("Tell me a story.", DEFAULT_MAX_TOKENS + 4,
                                                              ignore_eos=True)).json()
    assert out["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS + 4


def test_tokenization_runs_off_the_event_loop(live, monkeypatch):
    """While one request's prompt is being tokenized, /health answers: tokenization blocks here
    until the health check has come back, which would never happen on the event loop."""
    started, health_answered = threading.Event(), threading.Event()
    tokenize = live.engine.prompt_token_ids

    def blocking_tokenize(prompt):
        started.set()
        health_answered.wait(timeout=60)
        return tokenize(prompt)

    monkeypatch.setattr(live.engine, "prompt_token_ids", blocking_tokenize)
    responses = []
    request = threading.Thread(target=lambda: responses.append(
        _post(live.base, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})))
    request.start()
    started.wait(timeout=60)
    try:
        health = httpx.get(f"{live.base}/health", timeout=20)
    finally:
        health_answered.set()
        request.join()
    assert health.status_code == 200
    assert responses[0].status_code == 200, responses[0].text


def test_serve_flags_reach_the_server():
    from specrs.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-request-body-bytes", "1000", "--default-max-tokens", "64"])
    assert (args.max_request_body_bytes, args.default_max_tokens) == (1000, 64)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.max_request_body_bytes, defaults.default_max_tokens) == (8 * 1024 * 1024, 2048)
    with pytest.raises(ConfigError, match="max_request_body_bytes"):
        build_app(None, "x", max_request_body_bytes=0)


def test_serve_never_measures_costs_inside_a_request(monkeypatch, tmp_path):
    """A request whose config needs a cost nobody measured would time forwards in the generation
    thread, stalling every stream: requests read the figures at hand, and the engine's background
    thread measures what startup queued (the curve the draft budget reads, drafts up to 31)."""
    import specrs.serve

    # An empty cost cache: what other runs on this machine measured (the disk cache outlives a
    # process) must not decide which costs count as measured here.
    monkeypatch.setenv("SPECRS_CACHE_DIR", str(tmp_path))
    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.append(app))
    specrs.serve.serve(log_level="warning")
    engine = served[0].state.scheduler.engine
    params = specrs.SamplingParams(temperature=0, max_tokens=4)

    def source(k):
        r = engine.generate("Hello", params, speculative_config={"method": "ngram", "num_speculative_tokens": k})
        return r.metrics["verify_cost_source"]

    assert source(8) in ("prior", "measured") and source(40) in ("prior", "extrapolated")
    status = engine.cost_status()
    assert status["num_foreground_measurements"] == 0
    # What is missing waits for the background thread: the startup curve of 32 points (unless it
    # landed already) and the longer one the k = 40 request asked for.
    assert any("t(1..41)" in p for p in status["pending"]), status


def test_a_dead_generation_loop_makes_health_unhealthy(engine, caplog):
    """Should the scheduler's loop itself ever die (a bug outside any one request), /health says
    so with a 503 and the reason, the request in it fails, and new requests get a 503 at once."""
    from starlette.testclient import TestClient

    app = build_app(engine, MODEL, max_num_seqs=2)
    scheduler = app.state.scheduler

    def broken_submissions(block: bool = True):
        while not scheduler._submitted:  # the bug strikes once a request is queued
            threading.Event().wait(0.01)
        raise RuntimeError("injected scheduler bug")

    scheduler._next_submissions = broken_submissions
    with TestClient(app) as http:
        response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert _error(response, 503)["message"].count("injected scheduler bug") == 1
        health = http.get("/health")
        assert health.status_code == 503 and "injected scheduler bug" in health.json()["reason"]
        assert _error(http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4}), 503)["code"] == \
            "service_unavailable"
    assert any(r.name == "specrs.serve" and r.levelno == logging.ERROR for r in caplog.records)
