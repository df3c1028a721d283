"""`specrs serve --ray`: two engine replicas on a local Ray Serve (bound to 127.0.0.1, started and
stopped here), against the official `openai` client and a single `specrs serve` with the same
settings.

Checks: the same answers as the single server (chat, completions, streaming, seeded sampling);
a conversation's next turn goes to the replica that served it; a response learned on one replica
raises suffix acceptance for the same continuation on the other; /health and /metrics cover both
replicas; a replica killed mid-stream ends its stream with a clean error while the other replica's
stream finishes, a request that had not started answering is retried elsewhere, and the app serves
again, with two replicas, after Ray Serve restarts the dead one.

Everything here (both servers, Ray, the clients) runs in a private network namespace whose only
interface is the loopback: Ray binds its own servers to 127.0.0.1 (`specrs serve --ray` starts it
in its local-only mode), but Ray Serve opens each replica's inter-deployment gRPC port on every
interface, which the namespace keeps off the machine's network. Needs root and `unshare`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from test_serve import MAX_NUM_SEQS, PROMPTS, SERVER_SPEC, _free_port, _metric

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")

REPLICA = "x-specrs-replica"
START_TIMEOUT_S = 240


def _start(args: list[str], log_path, health_ok) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", *args, "--port", str(port), "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + START_TIMEOUT_S
    while True:
        try:
            response = httpx.get(f"{base}/health", timeout=2)
            if health_ok(response):
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"{' '.join(args)} did not start:\n{log_path.read_text()[-5000:]}")
        time.sleep(0.5)


def _wait_for_line(log_path, text: str, proc: subprocess.Popen) -> None:
    deadline = time.time() + START_TIMEOUT_S
    while text not in log_path.read_text():
        if proc.poll() is not None or time.time() > deadline:
            pytest.fail(f"no {text!r} in the server's log:\n{_specrs_lines(log_path)}")
        time.sleep(0.2)


def _specrs_lines(log_path) -> str:
    """The log's lines from specrs itself and its errors (Ray's per-call INFO lines drown them)."""
    return "\n".join(line for line in log_path.read_text().splitlines()
                     if "specrs serve" in line or "Error" in line or "WARNING" in line)[-5000:]


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # the Ray app shuts down on Ctrl-C
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _healthy(expected: int):
    def ok(response: httpx.Response) -> bool:
        return response.status_code == 200 and response.json().get("num_replicas_healthy", 1) >= expected \
            and response.json()["status"] == "ok"
    return ok


CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns failed")


@pytest.fixture(scope="module", autouse=True)
def private_network():
    """Moves this process's main thread (and so every server and client thread started from it)
    into a new network namespace with only `lo`, and back at the end."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip for a private network namespace")
    holder = subprocess.Popen(["unshare", "--net", "sh", "-c", "ip link set lo up && exec sleep 3600"])
    original = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        deadline = time.time() + 10
        while os.readlink(f"/proc/{holder.pid}/ns/net") == os.readlink("/proc/self/ns/net") or \
                "UP" not in subprocess.run(["nsenter", f"--net=/proc/{holder.pid}/ns/net", "ip", "-br", "link"],
                                           capture_output=True, text=True).stdout.replace("UNKNOWN", "UP"):
            assert time.time() < deadline, "the network namespace did not come up"
            time.sleep(0.05)
        target = os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY)
        _setns(target)
        os.close(target)
        yield original
    finally:
        _setns(original)
        os.close(original)
        holder.kill()
        holder.wait()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A single `specrs serve`, the reference."""
    log = tmp_path_factory.mktemp("single") / "server.log"
    proc, base = _start(["specrs.cli", "serve", "--max-num-seqs", str(MAX_NUM_SEQS), "--speculative-config",
                         json.dumps(SERVER_SPEC)], log, _healthy(1))
    yield base
    _stop(proc)


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory):
    """Two replicas (one CPU each) behind one endpoint, sharing the suffix cache every 0.5 s."""
    log = tmp_path_factory.mktemp("ray") / "server.log"
    proc, base = _start(["specrs.serve.ray", "--num-replicas", "2", "--replica-cpus", "1", "--max-num-seqs",
                         str(MAX_NUM_SEQS), "--suffix-share-interval", "0.5", "--speculative-config",
                         json.dumps(SERVER_SPEC)], log, _healthy(2))
    yield base
    _stop(proc)


def test_ray_stays_on_the_loopback(ray_app, private_network):
    """Ray's listeners are in the private namespace, whose only interface is the loopback, and Ray
    binds its own servers to 127.0.0.1 there; the machine's own network sees none of them."""
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert [link.split()[0] for link in links] == ["lo"], links
    listeners = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout.splitlines()
    ray = [line for line in listeners if any(name in line for name in ("gcs_server", "raylet", "ray::"))]
    assert ray, listeners
    wildcard = [line for line in ray if not line.split()[3].startswith(("127.", "[::ffff:127.", "[::1]"))]
    # Only Ray Serve's per-replica inter-deployment gRPC port ignores the node address.
    assert all("ServeRepli" in line for line in wildcard), "\n".join(wildcard)
    outside = subprocess.run(["nsenter", f"--net=/proc/self/fd/{private_network}", "ss", "-Hltnp"],
                             capture_output=True, text=True, check=True, pass_fds=(private_network,)).stdout
    assert not any(name in outside for name in ("gcs_server", "raylet", "ray::")), outside


def _client(base: str):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def _model(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]


def _chat(base: str, messages, max_tokens: int = 24, replica: str | None = None, **extra) -> tuple[dict, str]:
    """The JSON body and the replica that served a non-streamed chat request."""
    headers = {REPLICA: replica} if replica else {}
    response = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=300, json={
        "model": _model(base), "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json(), response.headers.get(REPLICA)


def _replicas(base: str) -> list[dict]:
    return [r for r in httpx.get(f"{base}/health", timeout=10).json()["replicas"] if r["healthy"]]


def _answers(base: str) -> list:
    client = _client(base)
    model = client.models.list().data[0].id
    out = []
    for i, prompt in enumerate(PROMPTS[:4]):
        kind, stream = ("chat", "completion")[i % 2], bool(i // 2)
        kwargs = dict(model=model, max_tokens=24, temperature=0, stream=stream)
        if kind == "chat":
            result = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs)
        else:
            result = client.completions.create(prompt=prompt, **kwargs)
        if stream:
            text = "".join((c.choices[0].delta.content if kind == "chat" else c.choices[0].text) or ""
                           for c in result if c.choices)
        else:
            text = result.choices[0].message.content if kind == "chat" else result.choices[0].text
        out.append(text)
    sampled = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[4]}],
                                             max_tokens=24, temperature=0.8, seed=7)
    out.append(sampled.choices[0].message.content)
    return out


def test_two_replicas_answer_as_a_single_server(single, ray_app):
    assert len(_replicas(ray_app)) == 2
    assert _answers(ray_app) == _answers(single)
    # Errors are the single server's too.
    for base in (single, ray_app):
        bad = httpx.post(f"{base}/v1/chat/completions", json={"model": _model(base), "messages": "hi"}, timeout=30)
        assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    assert httpx.get(f"{ray_app}/v1/nowhere", timeout=30).status_code == 404


def test_a_conversation_stays_on_its_replica(ray_app):
    served = set()
    for i in range(4):
        messages = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": f"Conversation {i}: {PROMPTS[i]}"}]
        body, first = _chat(ray_app, messages, max_tokens=8)
        served.add(first)
        for turn in range(2):
            messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"And then? ({turn})"}]
            body, replica = _chat(ray_app, messages, max_tokens=8)
            assert replica == first, f"turn {turn + 2} of conversation {i} left its replica"
    # A shared system prompt alone pins nobody: the conversations spread (8 fresh starts: both used).
    for i in range(4, 8):
        _, replica = _chat(ray_app, [{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": PROMPTS[i]}], max_tokens=4)
        served.add(replica)
    assert len(served) == 2


# Acceptance checks draft a fixed length: with adaptive draft length a replica on one busy CPU may
# measure drafting as not worth it and draft single tokens, which caps the accepted tokens per draft.
FIXED_LENGTH = {"speculative": {"adaptive_draft_length": False}}


def _accepted_per_draft(body: dict) -> float:
    return body["usage"]["speculative"]["mean_acceptance_length"]


def test_a_response_learned_on_one_replica_speeds_up_the_other(ray_app):
    a, b = [r["replica"] for r in _replicas(ray_app)]
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper named Ada."}]
    cold, served = _chat(ray_app, messages, max_tokens=96, replica=a, **FIXED_LENGTH)
    assert served == a
    # A publishes, B pulls (every exchange interval). B has the answer once A's outbox is empty and B
    # has received all A published (only A publishes to B). Replicas report every second: the
    # reports read after this sleep were made after the answer ended, so they count it.
    time.sleep(1.5)
    deadline = time.time() + 30
    while True:
        shares = {r["replica"]: r["suffix_share"] for r in _replicas(ray_app)}
        if shares[a]["pending"] == 0 and shares[b]["num_received"] >= shares[a]["num_published"] >= 1:
            break
        assert time.time() < deadline, f"replica {b} did not receive {a}'s responses: {shares}"
        time.sleep(0.25)
    warm, served = _chat(ray_app, messages, max_tokens=96, replica=b, **FIXED_LENGTH)
    assert served == b
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    shares = {r["replica"]: r["suffix_share"] for r in _replicas(ray_app)}
    assert shares[a]["num_published"] >= 1 and shares[b]["num_received"] >= 1, shares
    # Suffix decoding on B drafts the whole continuation from A's response.
    assert _accepted_per_draft(warm) >= 3.0, (warm["usage"], cold["usage"])
    assert _accepted_per_draft(warm) > _accepted_per_draft(cold) + 1.0, (warm["usage"], cold["usage"])


def test_health_and_metrics_cover_every_replica(ray_app):
    health = httpx.get(f"{ray_app}/health", timeout=10).json()
    assert health["status"] == "ok" and health["num_replicas_healthy"] == 2
    time.sleep(1.5)  # replicas report every second
    text = httpx.get(f"{ray_app}/metrics", timeout=10).text
    replicas = {r["replica"] for r in health["replicas"]}
    for replica in replicas:
        assert _metric(ray_app, "specrs:generation_tokens_total", replica=replica) > 0
        assert f'replica="{replica}"' in text
    assert _metric(ray_app, "specrs:spec_decode_num_drafts_total", method="suffix") > 0
    assert _metric(ray_app, "specrs:replicas", state="healthy") == 2
    assert text.count("# TYPE specrs:generation_tokens_total counter") == 1


def test_a_client_that_leaves_mid_stream_frees_its_replica(ray_app):
    """The disconnect travels proxy -> ingress -> replica: the replica cancels the generation."""
    body = {"model": _model(ray_app), "messages": [{"role": "user", "content": "Count to five hundred."}],
            "max_tokens": 2000, "temperature": 0, "stream": True, "speculative": False,
            "ignore_eos": True}  # however short the model's answer, only the abort can end it early
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{ray_app}/v1/chat/completions", json=body) as response:
            replica = response.headers[REPLICA]
            for i, _ in enumerate(response.iter_lines()):
                if i >= 4:
                    break
    # The replica reports every second: wait for a report that has it idle and the request aborted.
    deadline = time.time() + 30
    while True:
        running = [r for r in _replicas(ray_app) if r["replica"] == replica][0]["num_requests_running"]
        aborted = _metric(ray_app, "specrs:request_success_total", finished_reason="abort", replica=replica)
        if running == 0 and aborted >= 1:
            break
        if time.time() > deadline:
            finished = [line for line in httpx.get(f"{ray_app}/metrics", timeout=10).text.splitlines()
                        if line.startswith("specrs:request_success_total")]
            pytest.fail(f"the abandoned request still runs on {replica} ({running} running, {aborted} aborted); "
                        f"finished requests by reason: {finished}")
        time.sleep(0.5)


def _stream(base: str, replica: str, prompt: str, max_tokens: int, out: dict, ignore_eos: bool = False) -> None:
    """Streams a chat answer from `replica`; `out` gets its text, and the error if the stream ended in one.
    `ignore_eos`: the answer runs to max_tokens, however short the model's own answer is."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300,
                           default_headers={REPLICA: replica})
    texts = []
    try:
        for chunk in client.chat.completions.create(model=_model(base), messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=max_tokens, temperature=0, stream=True,
                                                    extra_body={"speculative": False, "ignore_eos": ignore_eos}):
            if chunk.choices:
                texts.append(chunk.choices[0].delta.content or "")
                out["chunks"] = len(texts)
    except openai.APIError as e:
        out["error"] = e
    out["text"] = "".join(texts)


RETRIED_LENGTH = {"max_tokens": 240, "ignore_eos": True}


def test_a_killed_replica_fails_cleanly_and_is_restarted(ray_app, single):
    replicas = _replicas(ray_app)
    (victim, survivor) = replicas
    prompt = "Count from one to two hundred in words, separated by commas."
    doomed, surviving, retried = {}, {}, {}
    # The doomed stream runs to its 400 tokens (SmolLM2's own answer here is 12 tokens, which could end
    # before the kill), so the kill always lands mid-stream.
    threads = [threading.Thread(target=_stream, args=(ray_app, victim["replica"], prompt, 400, doomed, True)),
               threading.Thread(target=_stream, args=(ray_app, survivor["replica"], prompt, 160, surviving))]
    for t in threads:
        t.start()
    deadline = time.time() + 120
    while doomed.get("chunks", 0) < 3 or surviving.get("chunks", 0) < 3:
        assert time.time() < deadline, (doomed, surviving)
        time.sleep(0.05)

    # A non-streamed request on the victim, still generating when it dies (it runs to its 240 tokens,
    # seconds next to the doomed stream, where 24 tokens could end before the kill): nothing was
    # sent, so the ingress retries it on the survivor.
    def non_streamed():
        try:
            retried["body"] = _chat(ray_app, [{"role": "user", "content": PROMPTS[6]}], replica=victim["replica"],
                                    **RETRIED_LENGTH)
        except AssertionError as e:
            retried["error"] = e
    waiter = threading.Thread(target=non_streamed)
    waiter.start()
    time.sleep(0.5)
    os.kill(victim["pid"], signal.SIGKILL)
    for t in [*threads, waiter]:
        t.join(timeout=300)

    assert "error" in doomed and "died" in str(doomed["error"]), doomed
    assert "error" not in surviving, surviving
    expected, _ = _chat(single, [{"role": "user", "content": prompt}], max_tokens=160)
    assert surviving["text"] == expected["choices"][0]["message"]["content"]
    assert "error" not in retried, retried
    body, replica = retried["body"]
    assert replica != victim["replica"]
    reference, _ = _chat(single, [{"role": "user", "content": PROMPTS[6]}], **RETRIED_LENGTH)
    assert body["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]

    # /health shows the loss until Ray Serve has restarted the replica, then two healthy ones again.
    # On a busy machine the streams above may end after the restart (it failed so beside a build):
    # then the loss is over, and the victim is no longer among the healthy replicas.
    deadline = time.time() + 10
    while time.time() < deadline:
        health = httpx.get(f"{ray_app}/health", timeout=10).json()
        restarted = victim["replica"] not in {r["replica"] for r in health["replicas"] if r["healthy"]}
        if health["num_replicas_healthy"] < 2 or restarted:
            break
        time.sleep(0.2)
    degraded = health["status"] == "degraded" and health["num_replicas_healthy"] == 1
    assert degraded or (restarted and health["num_replicas_healthy"] == 2), health
    deadline = time.time() + START_TIMEOUT_S
    while not _healthy(2)(httpx.get(f"{ray_app}/health", timeout=10)):
        assert time.time() < deadline, httpx.get(f"{ray_app}/health", timeout=10).json()
        time.sleep(1)
    after = {r["replica"] for r in _replicas(ray_app)}
    assert victim["replica"] not in after and survivor["replica"] in after
    for replica in after:
        body, served = _chat(ray_app, [{"role": "user", "content": PROMPTS[1]}], max_tokens=8, replica=replica)
        assert served == replica


# After Ctrl-C, how long the save round may take before the app is killed: seconds when quiet.
SAVE_AT_SHUTDOWN_S = 45


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (the Ray processes a `specrs serve --ray` started)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_the_shared_suffix_cache_survives_a_restart_of_the_whole_app(tmp_path):
    """With --suffix-cache, Ctrl-C first has every replica save its cache (which holds its peers'
    responses too), then tears the app down: even a shutdown that cannot proceed (Ray Serve's
    controller stopped here, as a loaded machine stalls it) and is then killed hard leaves the file.
    After a restart, the first replica seeds the shared log from the file and the other takes it
    from the log, so both draft the old response again; that app's own Ctrl-C saves the file again."""
    cache = tmp_path / "suffix.bin"
    args = ["specrs.serve.ray", "--num-replicas", "2", "--replica-cpus", "1", "--suffix-share-interval", "0.5",
            "--suffix-cache", str(cache), "--speculative-config", json.dumps(SERVER_SPEC)]
    messages = [{"role": "user", "content": "Describe a rainy afternoon in a small fishing village."}]
    proc, base = _start(args, tmp_path / "first.log", _healthy(2))
    # The handle for the save at shutdown is taken in the background once the coordinator answers.
    _wait_for_line(tmp_path / "first.log", "the coordinator answers", proc)
    ray_processes = _descendants(proc.pid)
    try:
        cold, _ = _chat(base, messages, max_tokens=64, **FIXED_LENGTH)
        controllers = [pid for pid in ray_processes if "ServeController" in _cmdline(pid)]
        assert len(controllers) == 1, [_cmdline(pid) for pid in ray_processes]
        os.kill(controllers[0], signal.SIGSTOP)  # the teardown now waits for it (30 s, then kills)
        proc.send_signal(signal.SIGINT)
        deadline = time.time() + SAVE_AT_SHUTDOWN_S
        while not cache.exists():
            assert time.time() < deadline, "no suffix cache file %d s after Ctrl-C:\n%s" % (
                SAVE_AT_SHUTDOWN_S, _specrs_lines(tmp_path / "first.log"))
            time.sleep(0.2)
    finally:
        proc.kill()  # hard, mid-shutdown
        proc.wait()
        for pid in ray_processes:  # the stopped controller too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    saved_at = cache.stat().st_mtime_ns
    proc, base = _start(args, tmp_path / "second.log", _healthy(2))
    try:
        for replica in [r["replica"] for r in _replicas(base)]:
            warm, served = _chat(base, messages, max_tokens=64, replica=replica, **FIXED_LENGTH)
            assert served == replica
            assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
            assert _accepted_per_draft(warm) >= 3.0, (replica, warm["usage"], cold["usage"])
    finally:
        _stop(proc)
    assert cache.stat().st_mtime_ns > saved_at, "the second app's Ctrl-C did not save the file"
