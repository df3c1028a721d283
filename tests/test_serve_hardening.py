"""The edges of `specrs serve` (issue 38, "Hardening III"): which weights a request may make the
server load, client mistakes that were 500s, what error bodies and /v1/models reveal, slow and
surplus connections, and the API key.

Live uvicorn servers run in threads of this process (as in test_serve_abuse.py), configured with
the same uvicorn settings `specrs serve` uses (`specrs.serve.uvicorn_settings`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading

import httpx
import pytest

import specrs
from specrs import _specrs
from specrs.heads import shipped_heads

uvicorn = pytest.importorskip("uvicorn")
from specrs.serve import build_app  # noqa: E402  (needs the serve extra, checked above)
from specrs.serve.protocol import APIError, ServerSpeculation  # noqa: E402
from test_serve_abuse import (MODEL, GoodStream, _alone, _chat_body, _error, _metric, _post,  # noqa: E402
                              serve_in_thread)

SERVER_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
CHAT = "/v1/chat/completions"
# Keys some methods need before they take a "model" (a new method needing more fails loudly here).
REQUIRED_KEYS = {"pard": {"mask_token_id": 1}, "layer_skip": {"exit_layer": 2}}


@pytest.fixture(scope="module")
def served(engine):
    """The session's engine served with an n-gram default, as `specrs serve` would."""
    app = build_app(engine, MODEL, max_num_seqs=4, default_max_tokens=8, draft_budget="off", body_timeout_s=2.0)
    with serve_in_thread(app, header_timeout_s=2.0) as (base, port, _):
        yield type("Served", (), {"base": base, "port": port, "engine": engine})()


# ---------------------------------------------------------------------------------------------
# Item 2: a request may name only weights the server holds.


def _method_config(method: str, **keys) -> dict:
    return {"method": method, "num_speculative_tokens": 2, **REQUIRED_KEYS.get(method, {}), **keys}


def _takes(config: dict) -> bool:
    """Whether the core accepts `config` (so only the server's own policy can refuse it)."""
    try:
        _specrs.SpeculativeConfig.from_json(json.dumps(config))
        return True
    except specrs.ConfigError:
        return False


@pytest.fixture(scope="module")
def head_copies(tmp_path_factory, engine):
    """Valid heads at paths the server does not know: copies of the shipped ones, and a directory
    whose config.json holds a value that must never come back in an error."""
    root = tmp_path_factory.mktemp("heads")
    copies = {}
    for method, path in shipped_heads(engine.info()).items():
        copies[method] = str(shutil.copytree(path, root / method))
    secret = root / "secret"
    secret.mkdir()
    (secret / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                    "hidden_size": "s3cr3t-value"}))
    copies["secret"] = str(secret)
    return copies


def test_every_method_that_takes_a_path_is_refused_one(served, head_copies):
    """For every method the core knows: a request naming a file, a missing path, or a real head the
    server never loaded gets the same 400, and nothing is loaded. A new method that takes a path
    is covered by this loop without anyone adding it."""
    methods = _specrs.Engine.speculative_methods()
    assert {"draft_model", "pard", "eagle", "eagle3", "mtp", "mlp_speculator", "medusa", "dflash", "dspark"} <= set(methods)
    loaded_before = served.engine.memory()["draft_weight_bytes"]
    paths = ["/etc/passwd", "/no/such/path", head_copies["secret"], *(v for k, v in head_copies.items()
                                                                         if k != "secret")]
    taking_paths = []
    for method in methods:
        bodies = []
        for path in paths:
            config = _method_config(method, model=path)
            error = _error(_post(served.base, CHAT, _chat_body("Hi", 4, speculative=config)), 400)
            assert error["param"] == "speculative", (method, error)
            assert "s3cr3t" not in error["message"] and path not in error["message"], (method, error)
            if _takes(config):
                assert "loads weights" in error["message"], (method, error)
                assert _specrs.SpeculativeConfig.from_json(json.dumps(config)).weights() is not None, method
            bodies.append(error)
        if _takes(_method_config(method, model="/etc/passwd")):
            taking_paths.append(method)
            # Whether the path exists, is a file, or holds a head: the answer is the same.
            assert all(body == bodies[0] for body in bodies), (method, bodies)
    assert set(taking_paths) == {"draft_model", "pard", "auto", "eagle", "eagle3", "mtp", "mlp_speculator", "medusa",
                                 "dflash", "dspark"}
    assert served.engine.memory()["draft_weight_bytes"] == loaded_before
    assert httpx.get(f"{served.base}/health").json()["status"] == "ok"


def test_weights_by_other_keys_are_refused_too(served):
    """quantized_self requantizes the target, a head's "quantization" re-quantizes it, and MTP
    without "model" reads the target's checkpoint: all load weights the server does not hold."""
    loaded_before = served.engine.memory()["draft_weight_bytes"]
    for config in ({"method": "quantized_self", "num_speculative_tokens": 2},
                   {"method": "quantized_self", "quantization": "q8_0", "num_speculative_tokens": 2},
                   {"method": "mtp", "num_speculative_tokens": 1}):
        error = _error(_post(served.base, CHAT, _chat_body("Hi", 4, speculative=config)), 400)
        assert "loads weights" in error["message"] and error["param"] == "speculative", error
    assert served.engine.memory()["draft_weight_bytes"] == loaded_before


def test_shipped_heads_and_the_startup_weights_stay_usable(served, engine, head_copies):
    """A head method without "model" gets the head specrs ships; the startup config's own weights
    may be named again, any other path may not."""
    shipped = shipped_heads(engine.info())
    assert "eagle3" in shipped
    out = _post(served.base, CHAT, _chat_body("Name three colors.", 8, speculative={"method": "eagle3"}))
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["speculative"]["method"] == "eagle3"
    startup = json.loads(engine.config_json({"method": "eagle3", "model": head_copies["eagle3"],
                                             "num_speculative_tokens": 3}))
    speculation = ServerSpeculation(startup, target_info=engine.info())
    again = json.loads(speculation.for_request({"method": "eagle3", "model": head_copies["eagle3"],
                                                "num_speculative_tokens": 2, "tree": True}).to_json())
    assert again["model"] == head_copies["eagle3"]
    assert speculation.for_request({"num_speculative_tokens": 2}).weights()["model"] == head_copies["eagle3"]
    assert speculation.for_request({"method": "eagle3"}).weights()["model"] == shipped["eagle3"]
    # "auto" with a head draws on the same weights: the shipped head, never a path of the client's.
    auto = speculation.for_request({"method": "auto", "draft_method": "eagle3"}).weights()
    assert auto["method"] == "eagle3" and auto["model"] == shipped["eagle3"]
    for other in ({"method": "eagle3", "model": "/etc/passwd", "num_speculative_tokens": 2},
                  {"method": "auto", "draft_method": "eagle3", "model": "/etc/passwd"},
                  {"method": "auto", "draft_method": "mlp_speculator", "model": head_copies["mlp_speculator"]},
                  {"method": "eagle3", "model": head_copies["eagle3"], "quantization": "q4_0",
                   "num_speculative_tokens": 2},
                  {"method": "mlp_speculator", "model": head_copies["mlp_speculator"], "num_speculative_tokens": 2}):
        with pytest.raises(APIError, match="loads weights"):
            speculation.for_request(other)


# ---------------------------------------------------------------------------------------------
# Item 3: client mistakes are 400s naming the field, never 500s nor "error" in /metrics.


def test_client_mistakes_are_400s_naming_the_field_and_not_counted_as_errors(served):
    errors_before = _metric(served.base, "specrs:request_success_total", finished_reason="error")
    base = json.dumps(_chat_body("Hi", 4))[:-1]
    cases = [
        (base + ', "logit_bias": {"42": 1e400}}', "logit_bias"),
        (base + ', "logit_bias": {"42": 1' + "0" * 400 + "}}", "logit_bias"),
        (base + ', "logit_bias": {"42": NaN}}', "logit_bias"),
        (base + ', "logit_bias": {"42": 101}}', "logit_bias"),
        (base + ', "logit_bias": {"99999999999999999999": 1}}', "logit_bias"),
        (base + ', "logit_bias": {"-5": 1}}', "logit_bias"),
        (base + ', "logit_bias": {"5": "x"}}', "logit_bias"),
        (base + f', "stop_token_ids": [{2**70}]}}', "stop_token_ids"),
        (base + ', "stop_token_ids": [99999999]}', "stop_token_ids"),
        (base + ', "temperature": -1}', "temperature"),
        (base + ', "top_p": 0}', "top_p"),
        (base + ', "presence_penalty": 3}', "presence_penalty"),
        (base + ', "repetition_penalty": 0}', "repetition_penalty"),
        (base + ', "model": ["a"]}', "model"),
        (base + ', "speculative": {"method": ["eagle3"]}}', "speculative"),
        (base + ', "speculative": {"method": {"a": 1}, "model": "x"}}', "speculative"),
        (base + ', "speculative": {"method": "suffix", "num_speculative_tokens": 1e400}}', "speculative"),
    ]
    for raw, param in cases:
        error = _error(_post(served.base, CHAT, raw), 400)
        assert error["param"] == param, (raw[len(base):], error)
    completion = _error(_post(served.base, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "logprobs": 6}), 400)
    assert completion["param"] == "logprobs"
    assert _metric(served.base, "specrs:request_success_total", finished_reason="error") == errors_before
    assert httpx.get(f"{served.base}/health").json()["status"] == "ok"


# ---------------------------------------------------------------------------------------------
# Item 5: what error bodies and /v1/models reveal.


def test_models_names_no_file(served, engine):
    models = httpx.get(f"{served.base}/v1/models")
    assert models.status_code == 200
    assert models.json()["data"][0]["root"] == MODEL
    assert engine.model_path not in models.text and os.path.basename(engine.model_path) not in models.text


def test_messages_quote_client_input_shortened(served):
    long = "x" * 20_000
    requests = [
        (CHAT, {**_chat_body("Hi", 4), "model": long}, 404),
        (CHAT, {**_chat_body("Hi", 4), long: 1}, 400),
        (CHAT, {**_chat_body("Hi", 4), **{f"{long}{i}": 1 for i in range(50)}}, 400),
        (CHAT, {**_chat_body("Hi", 4), "suffix": long}, 400),
        (CHAT, {**_chat_body("Hi", 4), "best_of": [long] * 100}, 400),
        (CHAT, _chat_body("Hi", 4, speculative={"method": "suffix", long: 1}), 400),
        (CHAT, _chat_body("Hi", 4, speculative={"method": long}), 400),
        (CHAT, _chat_body("Hi", 4, speculative={"method": [long]}), 400),
        (CHAT, _chat_body("Hi", 4, speculative={"method": "suffix", "tree": long}), 400),
        (CHAT, _chat_body("Hi", 4, logit_bias={long: 1}), 400),
        (CHAT, _chat_body("Hi", 4, temperature=long), 400),
    ]
    for path, body, status in requests:
        response = _post(served.base, path, body)
        error = _error(response, status)
        assert len(response.content) < 2000 and "x" * 100 not in response.text, (status, error)
        assert error["param"] is None or len(error["param"]) <= 80, error


BACKTRACE_CHECK = textwrap.dedent("""
    import json, re, sys
    from starlette.testclient import TestClient
    import specrs
    from specrs import _specrs
    from specrs.serve import build_app

    frame = re.compile(r"^\\s+\\d+: |^\\s+at \\S+:\\d+", re.MULTILINE)
    # The test-only proposer fails its first propose() as candle does under RUST_BACKTRACE: the
    # message, then the backtrace of where the error was made.
    failing = {"method": "custom", "num_speculative_tokens": 2, "adaptive_draft_length": False}
    engine = specrs.Engine(speculative_config=failing, proposer=_specrs._testing_panicking_proposer(0, "propose_error"))
    messages = []
    try:
        engine.generate("Hello", specrs.SamplingParams(max_tokens=4))
        sys.exit("the failing proposer did not fail")
    except specrs.SpecrsError as e:
        messages.append(str(e))
    with TestClient(build_app(engine, "m", default_max_tokens=4)) as http:
        response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert response.status_code == 500, response.text
        messages.append(response.text)
        for body in ('{"prompt": "Hi", "logit_bias": {"1": 1e400}}',
                     '{"prompt": "Hi", "speculative": {"method": "eagle3", "model": "/etc/passwd", '
                     '"num_speculative_tokens": 2}}'):
            messages.append(http.post("/v1/completions", content=body,
                                      headers={"Content-Type": "application/json"}).text)
    print(json.dumps({"messages": messages, "frames": [m for m in messages if frame.search(m)]}))
""")


def test_no_backtrace_reaches_a_message_or_an_error_body(tmp_path):
    """With RUST_BACKTRACE=1 (read once per process, so in a process of its own), candle appends a
    backtrace to its errors; neither a Python exception's message nor an error body carries it."""
    result = subprocess.run([sys.executable, "-c", BACKTRACE_CHECK], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "RUST_BACKTRACE": "1"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-5000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["frames"] == [], out["frames"][0][:3000]
    assert all("testing tensor error" in m for m in out["messages"][:2]), out["messages"][:2]


# ---------------------------------------------------------------------------------------------
# Item 5: slow clients and too many connections.


def _read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(60)  # generous: the server's own deadline decides, this only ends a hung test
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_slow_headers_and_slow_bodies_are_cut_while_others_are_served(served):
    """A client that sends nothing, one that stops half way through its headers (on a new or a
    kept-alive connection), and one that stops half way through its body each get a 408 and a
    closed connection once the deadline passed (2 s here); meanwhile a normal request is answered."""
    idle = socket.create_connection(("127.0.0.1", served.port))
    slow_headers = socket.create_connection(("127.0.0.1", served.port))
    slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: appl")
    # On a kept-alive connection, the next request's headers have their own deadline.
    kept_alive = socket.create_connection(("127.0.0.1", served.port))
    kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    first = b""
    while b"\r\n\r\n" not in first or len(first.partition(b"\r\n\r\n")[2]) < int(
            re.search(rb"content-length: (\d+)", first.partition(b"\r\n\r\n")[0].lower()).group(1)):
        first += kept_alive.recv(65536)
    assert first.startswith(b"HTTP/1.1 200"), first
    kept_alive.sendall(b"GET /hea")
    slow_body = socket.create_connection(("127.0.0.1", served.port))
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": \"Hel")
    ok = _post(served.base, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200, ok.text
    for sock, words in ((idle, b"request line and headers"), (slow_headers, b"request line and headers"),
                        (kept_alive, b"request line and headers"), (slow_body, b"request body")):
        with sock:
            answer = _read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        head, _, body = answer.partition(b"\r\n\r\n")
        assert words in body and json.loads(body)["error"]["code"] == "request_timeout", answer
    assert httpx.get(f"{served.base}/health").json()["status"] == "ok"


def test_connections_past_the_limit_are_refused_and_streams_go_on(engine):
    """With room for 4 connections: a running stream and 3 idle sockets fill it; a fifth connection
    gets a 503 and is closed at once, and the stream still ends with the output it gets alone."""
    app = build_app(engine, MODEL, max_num_seqs=4, draft_budget="off")
    with serve_in_thread(app, header_timeout_s=300.0, max_connections=4) as (base, port, _):
        good = GoodStream(base)
        good.first_chunk.wait()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:
            with socket.create_connection(("127.0.0.1", port)) as surplus:
                answer = _read_until_closed(surplus)
            assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
        finally:
            for sock in idle:
                sock.close()
        assert good.text() == _alone(engine) and good.finish_reason in ("stop", "length")
        # The closed sockets free their places (the server sees them go shortly after).
        for _ in range(600):
            response = httpx.get(f"{base}/health")
            if response.status_code == 200:
                break
            threading.Event().wait(0.05)
        assert response.status_code == 200


# ---------------------------------------------------------------------------------------------
# Item 6: the API key.

KEY = "sk-test-0123456789"
ROUTES = [("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
          ("POST", CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
          ("GET", "/v1/models", None), ("GET", "/metrics", None),
          ("GET", "/nowhere", None)]


def _check_key_required(http, metrics_public: bool = False) -> None:
    for method, path, body in ROUTES:
        public = metrics_public and path == "/metrics"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": f"Bearer {KEY}x"}, {"Authorization": "Bearer "}):
            response = http.request(method, path, json=body, headers=headers)
            if public:
                assert response.status_code == 200, (path, headers)
                continue
            error = _error(response, 401)
            assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer", error
        response = http.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == (404 if path == "/nowhere" else 200), (path, response.text)
    assert http.get("/health").status_code == 200  # load balancers probe it without a key


def test_api_key_guards_every_route_but_health(engine):
    from starlette.testclient import TestClient

    with TestClient(build_app(engine, MODEL, default_max_tokens=2, api_key=KEY)) as http:
        _check_key_required(http)
    with TestClient(build_app(engine, MODEL, default_max_tokens=2, api_key=KEY, metrics_public=True)) as http:
        _check_key_required(http, metrics_public=True)
    with pytest.raises(specrs.ConfigError, match="empty"):
        build_app(engine, MODEL, api_key="")


def test_serve_reads_the_api_key_flag_and_environment(engine, monkeypatch):
    """`specrs serve --api-key` and SPECRS_API_KEY reach the app `serve` runs (uvicorn is not
    started: its `run` is replaced), with the connection limits in uvicorn's settings."""
    from starlette.testclient import TestClient

    import specrs.serve
    from specrs.cli import build_parser

    served = []
    monkeypatch.setattr(specrs.serve, "load_engine", lambda *args: engine)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.append((app, kwargs)))
    monkeypatch.setenv("SPECRS_API_KEY", KEY)
    args = build_parser().parse_args(["serve", "--header-timeout", "3", "--max-connections", "7",
                                      "--body-timeout", "4"])
    args.func(args)
    app, kwargs = served[-1]
    assert kwargs["timeout_keep_alive"] == 5 and kwargs["http"].__name__ == "LimitedHTTPProtocol"
    with TestClient(app) as http:
        _check_key_required(http)
    monkeypatch.delenv("SPECRS_API_KEY")
    args = build_parser().parse_args(["serve", "--api-key", "other-key", "--metrics-public"])
    args.func(args)
    with TestClient(served[-1][0]) as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer other-key"}).status_code == 200
        assert http.get("/metrics").status_code == 200
    args = build_parser().parse_args(["serve"])
    args.func(args)
    with TestClient(served[-1][0]) as http:
        assert http.get("/v1/models").status_code == 200  # no key anywhere: no authentication
    with pytest.raises(specrs.ConfigError, match="header_timeout"):
        args = build_parser().parse_args(["serve", "--header-timeout", "0"])
        args.func(args)


def test_ray_refuses_the_connection_flags_it_cannot_honour():
    """With --ray, Ray Serve's HTTP proxy holds the connections: the flags that would limit ours
    are refused rather than silently ignored; the key and the body timeout reach the ingress."""
    from specrs.cli import build_parser

    for flags in (["--header-timeout", "3"], ["--max-connections", "9"], ["--timeout-keep-alive", "9"]):
        args = build_parser().parse_args(["serve", "--ray", *flags])
        with pytest.raises(specrs.ConfigError, match="without --ray"):
            args.func(args)
    for flags, words in ((["--body-timeout", "0"], "body_timeout"), (["--api-key", " "], "empty")):
        args = build_parser().parse_args(["serve", "--ray", *flags])
        with pytest.raises(specrs.ConfigError, match=words):
            args.func(args)
