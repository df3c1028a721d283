"""`specrs serve --ray` against plain `specrs serve` on one machine: the overhead of Ray Serve with
1 and 2 engine replicas, and suffix acceptance on a repeated workload with and without the suffix
cache the replicas share. Output: JSON.

On a 2-core machine these numbers are about overhead, not scale: two replicas split the same two
cores that one engine uses alone, so `ray_2` cannot beat `single` on throughput here; what the
figures show is what the Ray hop (HTTP proxy -> ingress -> router -> replica actor, responses
streamed back the same way), the replicas' reporting and the suffix exchange cost, and what a shared
suffix cache buys a repeated request that lands on another replica.

Every server is a fresh process started by this script on a free port (in its own session, output
to a log file in `--log-dir`), waited for, and stopped afterwards, one at a time, all serving the
same GGUF (`--model-path`; default the SmolLM2-135M-Instruct Q4_1 file, as `--python` resolves it)
with the same `--spec-config` (default suffix decoding, k = 4) and `--max-num-seqs` (4):
- `single`: `python -m specrs.cli serve MODEL --host 127.0.0.1 --port P ...`, one engine using every
  core; ready when GET /health answers 200;
- `ray_1`: `python -m specrs.serve.ray MODEL ... --num-replicas 1 --replica-cpus 2`: one replica
  that reserves and runs its forwards on 2 CPUs (RAYON_NUM_THREADS=2), so the engine does the same
  work as `single` and only the Ray path differs;
- `ray_2`: `... --num-replicas 2 --replica-cpus 1`: two replicas of one thread each on the same 2
  cores.
The Ray configurations run Ray's defaults otherwise (a local Ray instance bound to 127.0.0.1, the
suffix cache shared between replicas every 1 s, prefix-affinity routing); a Ray app is ready when
GET /health answers {"status": "ok"} with `num_replicas_healthy` >= its replicas. `startup_s` is
process start -> ready (Ray + model load for the Ray app, ~30-90 s; a single server ~5-15 s). A
Ray app is stopped with SIGINT to its process (it shuts Serve and Ray down), SIGKILL to its
process group after 60 s, and any process of its group still alive 10 s after it exited is killed
too (`stop` in the JSON says which happened); a single server gets serve_bench's SIGTERM to its
process group. The driver sets RAY_USAGE_STATS_ENABLED=0 for the Ray apps (no telemetry).

Part A, overhead (`--parts overhead`). Workload: the first `--requests-per-level` (12) first turns
of Spec-Bench (`--questions`, question.jsonl; never copied here), round-robin over the categories
in file order (serve_bench.load_questions); chat completions, greedy (temperature 0),
`--max-tokens` (64), stop at EOS, streamed with usage on every chunk. Suffix decoding caches every
response, so a prompt seen before would be drafted better: every concurrency level of every
configuration gets its own fresh server and sees the prompts cold. After one excluded warm-up
request per replica ("Say hello.", 8 tokens; on the Ray apps pinned to each replica with the
`x-specrs-replica` header, so no replica pays its first forward inside the level), each level
(`--concurrency`, default 1,4) runs that many closed-loop streaming clients over the requests
(serve_bench.run_level). Measured at the client, per level:
- requests/s: requests that succeeded / level wall time (first request sent -> last response
  ended);
- output tokens/s: completion tokens of all requests / level wall time;
- TTFT: request sent -> first chunk with text (queue time and prefill included), p50/p99 over
  requests;
- ITL: per request, (last text chunk - first text chunk) / (tokens delivered after the first
  text chunk), its mean inter-token latency after the first token; p50/p99 over requests;
- errors: failed requests (no ratios for a level with one);
- `speculative`: per-request `usage.speculative` summed over the level: drafts, draft tokens,
  accepted tokens, mean acceptance length = 1 + accepted / drafts;
- `same_text`: requests whose text (sha1) equals `single`'s at that level (greedy: all of them);
- `requests_per_replica` (Ray apps): the change of `specrs:request_success_total` per replica
  label on the app's /metrics over the level; the replicas report every 1 s, so each scrape waits
  2.5 s after the warm-up / after the level (outside every timed window).
Percentiles interpolate linearly (serve_bench.percentiles). Derived: `ratios`, for `ray_1` and
`ray_2` over `single` at each level: requests/s, output tokens/s, TTFT p50 and ITL p50 (above 1
is better for the first two, worse for the last two); null where either level failed a request.

Part B, shared suffix cache (`--parts shared`). A fresh `ray_2` app twice: `shared` (the default,
sharing on) and `unshared` (`--no-share-suffix-cache`), both with `--suffix-share-interval 0.5`.
The replicas A and B are the first two healthy ones of /health (sorted by id); after one warm-up
request pinned to each ("Say hello.", 8 tokens) and a 3 s wait, the workload is the first
`--repeat-prompts` (8) Spec-Bench prompts, each a non-streamed chat completion (temperature 0,
`--max-tokens`), sent one at a time:
- pass 1: each prompt once, pinned alternately to A and B (`x-specrs-replica`); the replica that
  served it (the response's `x-specrs-replica`) is recorded;
- a 3 s wait (6 exchange intervals; a response reaches a peer's cache within about 2 intervals);
- pass 2 (cross-replica repeat): each prompt again, pinned to the OTHER replica than pass 1's.
  With sharing, that replica holds pass 1's response in its suffix cache (received from its peer);
  without sharing, it never saw that response, so its drafts for the repeat are cold (only the
  prompt and what it generated itself in pass 1 for other prompts help);
- a 3 s wait, then pass 3: each prompt again without a pin header: prefix-affinity routing
  decides. The router remembers, per prompt, the replica it last routed it to (pinned requests
  included), so pass 3 is expected on pass 2's replica; either way it lands on a replica that
  generated this very response itself, so pass 3 is warm in both variants. Its replica is recorded
  with whether it equals pass 1's and pass 2's.
Per pass: summed `usage.speculative` num_drafts, num_draft_tokens, num_accepted_tokens; mean
acceptance length = 1 + accepted / drafts; acceptance rate = accepted / draft tokens; request
latency (sent -> response read, at the client) mean and p50/p99; completion tokens / summed
latency; how many requests the pinned replica served; how many texts (sha1) equal pass 1's
(greedy, so all must). Derived: `cross_replica_acceptance_gain` = pass 2's mean acceptance length
with sharing / without; `pass2_latency_ratio` = pass 2's mean latency with sharing / without (below
1: sharing made the repeat faster); per variant pass 2 and pass 3 over pass 1 (mean acceptance
length, mean latency); and how many pass-1 texts are equal across the two variants. Null where a
pass had a failed request.

Needs: `--python` (default this checkout's .venv/bin/python) with specrs, its `serve` extra and the
`ray` extra (`pip install 'specrs[ray]'`). This driver itself uses only the standard library and
httpx (and benches/serve_bench.py); it never imports ray or specrs. A server that fails to start is
recorded (`error`, with the end of its log) for that configuration, whose remaining levels are
skipped, and the run goes on; the exit status is 1 when anything failed.

    .venv/bin/python benches/ray_bench.py --questions ../shared/data/spec_bench/question.jsonl \\
        --out bench-results/ray_bench.json
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_bench  # noqa: E402  (the helpers of benches/serve_bench.py)

REPO = serve_bench.REPO
PARTS = ["overhead", "shared"]
OVERHEAD_CONFIGS = ["single", "ray_1", "ray_2"]
RAY_SHAPES = {"ray_1": (1, 2), "ray_2": (2, 1)}  # (num_replicas, replica_cpus)
SHARED_VARIANTS = ["shared", "unshared"]
DEFAULT_SPEC = '{"method": "suffix", "num_speculative_tokens": 4}'
REPLICA_HEADER = "x-specrs-replica"
WARMUP_PROMPT = serve_bench.WARMUP_PROMPT
WARMUP_TOKENS = 8
SHARE_INTERVAL_S = 0.5  # --suffix-share-interval of part B
SHARE_WAIT_S = 3.0  # between part B's passes: 6 exchange intervals
METRICS_WAIT_S = 2.5  # replicas report their metrics every 1 s
RAY_STOP_S = 60.0  # SIGINT -> SIGKILL of the process group
GROUP_LINGER_S = 10.0  # after the Ray driver exited, how long its process group may take to empty
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}

_ray_apps: list[subprocess.Popen] = []  # Ray app processes this script started (also in serve_bench._servers)


# ---------------------------------------------------------------------------------------------
# Servers


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_ray_app(proc: subprocess.Popen) -> dict:
    """SIGINT to the Ray driver (it shuts Serve and Ray down on KeyboardInterrupt), SIGKILL to its
    process group after RAY_STOP_S; then kills what is left of the group after GROUP_LINGER_S.
    serve_bench.stop_server runs last whatever happens (a second Ctrl-C included)."""
    t = time.perf_counter()
    info: dict = {"how": "already exited", "returncode": proc.poll()}
    try:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGINT)
                proc.wait(timeout=RAY_STOP_S)
                info = {"how": "sigint", "returncode": proc.returncode}
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                info = {"how": f"sigkill to the process group after {RAY_STOP_S:.0f} s", "returncode": proc.poll()}
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GROUP_LINGER_S
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _group_alive(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            info["group_killed"] = True
    finally:
        serve_bench.stop_server(proc)  # no-op once it exited; removes it from serve_bench._servers
        if proc in _ray_apps:
            _ray_apps.remove(proc)
    info["stop_s"] = time.perf_counter() - t
    return info


def stop_everything() -> None:
    for proc in list(_ray_apps):
        try:
            stop_ray_app(proc)
        except BaseException:  # noqa: BLE001 - on the way out, the fallback below still runs
            pass
    serve_bench.stop_all_servers()


def healthy_replicas(health: dict | None) -> list[str]:
    rows = (health or {}).get("replicas") or []
    return sorted(str(r["replica"]) for r in rows if isinstance(r, dict) and r.get("healthy") and "replica" in r)


def get_health(base: str) -> tuple[int, dict | None]:
    response = httpx.get(f"{base}/health", timeout=5)
    try:
        body = response.json()
    except ValueError:
        body = None
    return response.status_code, body if isinstance(body, dict) else None


def start_ray_app(command: list[str], port: int, replicas: int, log_path: str,
                  timeout: float) -> tuple[subprocess.Popen, dict]:
    """serve_bench.start_server's pattern, ready when /health says "ok" with `replicas` healthy."""
    log = open(log_path, "ab")
    try:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO, env={**os.environ, **RAY_ENV})
    finally:
        log.close()
    serve_bench._servers.append(proc)
    _ray_apps.append(proc)
    base = f"http://127.0.0.1:{port}"
    last = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            code, body = get_health(base)
            last = {"status_code": code, "body": body}
            if (body and body.get("status") == "ok" and (body.get("num_replicas_healthy") or 0) >= replicas
                    and len(healthy_replicas(body)) >= replicas):
                return proc, body
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    status = (f"exited with status {proc.returncode}" if proc.poll() is not None
              else f"not ready after {timeout:.0f} s (last /health: {json.dumps(last)[:500]})")
    stop_ray_app(proc)
    raise serve_bench.ServerFailed(f"Ray app {status}: {' '.join(command)}\n--- last lines of {log_path} ---\n"
                                   f"{serve_bench.log_tail(log_path)}")


def server_command(name: str, args: argparse.Namespace, port: int | str, extra=()) -> list[str]:
    common = [args.model_path, "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
              "--speculative-config", args.spec_config, "--log-level", "warning"]
    if name == "single":
        return [args.python, "-m", "specrs.cli", "serve", *common]
    replicas, cpus = RAY_SHAPES[name]
    return [args.python, "-m", "specrs.serve.ray", *common, "--num-replicas", str(replicas), "--replica-cpus",
            str(cpus), *extra]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    startup_s: float
    replicas: list[str] = field(default_factory=list)  # healthy replica ids (Ray apps)
    health: dict | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def is_ray(self) -> bool:
        return self.name != "single"


def launch(name: str, args: argparse.Namespace, log_path: str, extra=()) -> Server:
    port = serve_bench.free_port()
    command = server_command(name, args, port, extra)
    t = time.perf_counter()
    if name == "single":
        proc = serve_bench.start_server(command, port, "/health", log_path, args.startup_timeout)
        startup = time.perf_counter() - t
        try:
            health = get_health(f"http://127.0.0.1:{port}")[1]
        except httpx.HTTPError:
            health = None
        return Server(name, proc, port, startup, [], health)
    proc, health = start_ray_app(command, port, RAY_SHAPES[name][0], log_path, args.startup_timeout)
    return Server(name, proc, port, time.perf_counter() - t, healthy_replicas(health), health)


def stop(server: Server) -> dict:
    if server.is_ray:
        return stop_ray_app(server.proc)
    t = time.perf_counter()
    serve_bench.stop_server(server.proc)
    return {"how": "sigterm to the process group", "returncode": server.proc.poll(),
            "stop_s": time.perf_counter() - t}


def requests_per_replica(base: str) -> dict[str, float] | None:
    """Summed `specrs:request_success_total` per `replica` label of /metrics ("-" without one)."""
    try:
        response = httpx.get(f"{base}/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    out: dict[str, float] = {}
    for line in response.text.splitlines():
        if not line.startswith("specrs:request_success_total"):
            continue
        key, _, value = line.rpartition(" ")
        match = re.search(r'replica="([^"]*)"', key)
        replica = match.group(1) if match else "-"
        try:
            out[replica] = out.get(replica, 0.0) + float(value)
        except ValueError:
            pass
    return out


def client(args: argparse.Namespace, pin: str | None = None) -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(args.request_timeout, connect=30),
                        headers={REPLICA_HEADER: pin} if pin else None)


# ---------------------------------------------------------------------------------------------
# Part A: overhead


def run_overhead_config(record: dict, name: str, args: argparse.Namespace, prompts: list[dict], levels: list[int],
                        log_dir: str) -> None:
    """One fresh server per level; fills `record` level by level, so a failure keeps what was measured."""
    record["command"] = server_command(name, args, "PORT")
    if name in RAY_SHAPES:
        record["num_replicas"], record["replica_cpus"] = RAY_SHAPES[name]
    record["levels"] = {}
    work = prompts[:args.requests_per_level]
    for level in levels:
        row: dict = {}
        record["levels"][str(level)] = row
        log_path = os.path.join(log_dir, f"{name}_c{level}.log")
        row["log"] = log_path
        try:
            server = launch(name, args, log_path)
        except serve_bench.ServerFailed as e:
            row["error"] = str(e)
            record["error"] = f"server start failed at {level} client(s); later levels skipped"
            print(f"{name} c={level}: {e}", file=sys.stderr, flush=True)
            return
        row.update({"port": server.port, "startup_s": server.startup_s, "replicas": server.replicas})
        try:
            for pin in server.replicas or [None]:  # warm-up, not recorded: every replica once
                with client(args, pin) as c:
                    serve_bench.stream_one(c, server.base, WARMUP_PROMPT, WARMUP_TOKENS, True, {})
            before = None
            if server.is_ray:
                time.sleep(METRICS_WAIT_S)
                before = requests_per_replica(server.base)
            result = serve_bench.run_level(server.base, work, level, args, True, {})
            if server.is_ray:
                time.sleep(METRICS_WAIT_S)
                after = requests_per_replica(server.base)
                row["requests_per_replica"] = (None if after is None or before is None else
                                               {k: v - before.get(k, 0.0) for k, v in after.items()})
            row.update(result)
            row["requests_per_s"] = result["num_ok"] / result["wall_s"] if result["num_ok"] else None
            spec = result.get("speculative") or {}
            print(f"{name:7s} c={level:2d} n={len(work):3d} startup {server.startup_s:5.1f} s | "
                  f"{serve_bench.fmt(row['requests_per_s'], '6.2f')} req/s "
                  f"{serve_bench.fmt(result['output_tokens_per_s'], '7.1f')} tok/s | TTFT p50 "
                  f"{serve_bench.fmt_ms(result['ttft_s']['p50'])} p99 {serve_bench.fmt_ms(result['ttft_s']['p99'])} | "
                  f"ITL p50 {serve_bench.fmt_ms(result['itl_s']['p50'])} p99 "
                  f"{serve_bench.fmt_ms(result['itl_s']['p99'])} | MAL "
                  f"{serve_bench.fmt(spec.get('mean_acceptance_length'), '.2f')} | errors {result['num_errors']}",
                  file=sys.stderr, flush=True)
        except Exception as e:  # recorded; the next level starts a fresh server
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"{name} c={level} failed: {row['error']}", file=sys.stderr, flush=True)
        finally:
            row["stop"] = stop(server)


def level_ok(configs: dict, name: str, level: int) -> dict | None:
    row = (configs.get(name) or {}).get("levels", {}).get(str(level))
    return row if row and "error" not in row and row.get("num_errors") == 0 and row.get("num_ok") else None


def overhead_ratios(configs: dict, levels: list[int]) -> dict:
    out = {}
    for name in ("ray_1", "ray_2"):
        if name not in configs:
            continue
        out[name] = {}
        for level in levels:
            a, b = level_ok(configs, name, level), level_ok(configs, "single", level)
            out[name][str(level)] = {
                "requests_per_s": serve_bench.ratio(a and a["requests_per_s"], b and b["requests_per_s"]),
                "output_tokens_per_s": serve_bench.ratio(a and a["output_tokens_per_s"],
                                                         b and b["output_tokens_per_s"]),
                "ttft_p50": serve_bench.ratio(a and a["ttft_s"]["p50"], b and b["ttft_s"]["p50"]),
                "itl_p50": serve_bench.ratio(a and a["itl_s"]["p50"], b and b["itl_s"]["p50"]),
            }
    return out


def mark_same_text(configs: dict, levels: list[int]) -> None:
    """Per level, how many requests of each configuration gave `single`'s text."""
    for level in levels:
        reference = ((configs.get("single") or {}).get("levels") or {}).get(str(level))
        if not reference or "requests" not in reference:
            continue
        texts = {r["question_id"]: r.get("text_sha1") for r in reference["requests"]}
        for record in configs.values():
            row = (record.get("levels") or {}).get(str(level))
            if row and "requests" in row:
                row["same_text"] = {"reference": "single", "count": sum(
                    1 for r in row["requests"] if r.get("text_sha1") and r["text_sha1"] == texts.get(r["question_id"]))}


def overhead_table(configs: dict, levels: list[int], ratios: dict) -> str:
    lines = ["| config | clients | requests | startup | req/s | vs single | tok/s | vs single | TTFT p50 | "
             "vs single | TTFT p99 | ITL p50 | ITL p99 | mean acc. length | same text | errors |", "|---" * 16 + "|"]
    for name, record in configs.items():
        for level in levels:
            row = (record.get("levels") or {}).get(str(level))
            if not row:
                continue
            if "num_ok" not in row:
                lines.append(f"| {name} | {level} | - | {serve_bench.fmt(row.get('startup_s'), '.1f', '- ')}s | "
                             f"failed: {(row.get('error') or '?').splitlines()[0][:100]} |")
                continue
            r = ratios.get(name, {}).get(str(level), {})
            same = row.get("same_text")
            spec = row.get("speculative") or {}
            lines.append(
                f"| {name} | {level} | {row['num_requests']} | {serve_bench.fmt(row.get('startup_s'), '.1f')} s | "
                f"{serve_bench.fmt(row['requests_per_s'], '.2f')} | "
                f"{serve_bench.fmt(r.get('requests_per_s'), '.2f')} | "
                f"{serve_bench.fmt(row['output_tokens_per_s'], '.1f')} | "
                f"{serve_bench.fmt(r.get('output_tokens_per_s'), '.2f')} | "
                f"{serve_bench.fmt_ms(row['ttft_s']['p50'])} | "
                f"{serve_bench.fmt(r.get('ttft_p50'), '.2f')} | {serve_bench.fmt_ms(row['ttft_s']['p99'])} | "
                f"{serve_bench.fmt_ms(row['itl_s']['p50'])} | {serve_bench.fmt_ms(row['itl_s']['p99'])} | "
                f"{serve_bench.fmt(spec.get('mean_acceptance_length'), '.2f')} | "
                f"{'-' if not same else str(same['count']) + '/' + str(row['num_requests'])} | {row['num_errors']} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Part B: shared suffix cache


def chat(c: httpx.Client, base: str, content: str, max_tokens: int, pin: str | None) -> dict:
    """One non-streamed greedy chat completion, pinned to replica `pin` when given."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    response = c.post(f"{base}/v1/chat/completions", json=body, headers={REPLICA_HEADER: pin} if pin else None)
    latency = time.perf_counter() - t0
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    data = response.json()
    choice = (data.get("choices") or [{}])[0]
    usage = data.get("usage") or {}
    text = (choice.get("message") or {}).get("content") or ""
    return {"replica": response.headers.get(REPLICA_HEADER), "latency_s": latency,
            "completion_tokens": usage.get("completion_tokens"), "prompt_tokens": usage.get("prompt_tokens"),
            "finish_reason": choice.get("finish_reason"), "speculative": usage.get("speculative"),
            "text_sha1": hashlib.sha1(text.encode()).hexdigest()}


def run_pass(c: httpx.Client, base: str, work: list[dict], pins: list[str | None], max_tokens: int) -> list[dict]:
    rows = []
    for prompt, pin in zip(work, pins):
        row = {"question_id": prompt["question_id"], "category": prompt["category"], "pin": pin}
        try:
            row.update(chat(c, base, prompt["content"], max_tokens, pin))
        except Exception as e:  # counted; the pass goes on
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
    return rows


def summarize_pass(rows: list[dict], pin_rule: str, pass1: list[dict] | None, pass2: list[dict] | None) -> dict:
    ok = [r for r in rows if "error" not in r]
    spec = [r["speculative"] for r in ok if r.get("speculative")]
    drafts = sum(s.get("num_drafts") or 0 for s in spec)
    draft_tokens = sum(s.get("num_draft_tokens") or 0 for s in spec)
    accepted = sum(s.get("num_accepted_tokens") or 0 for s in spec)
    latencies = [r["latency_s"] for r in ok]
    tokens = sum(r.get("completion_tokens") or 0 for r in ok)
    out = {
        "pin": pin_rule,
        "num_requests": len(rows), "num_ok": len(ok), "num_errors": len(rows) - len(ok),
        "errors": [f"{r['question_id']}: {r['error']}" for r in rows if "error" in r][:10],
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "mean_latency_s": sum(latencies) / len(latencies) if latencies else None,
        "latency_s": serve_bench.percentiles(latencies),
        "completion_tokens": tokens,
        "tokens_per_s": tokens / sum(latencies) if latencies and sum(latencies) > 0 else None,
        "on_pinned_replica": (sum(1 for r in ok if r["replica"] == r["pin"]) if any(r["pin"] for r in rows)
                              else None),
        "requests": rows,
    }
    if pass1 is not None:
        out["same_text_as_pass1"] = sum(1 for r, p in zip(rows, pass1)
                                        if "error" not in r and "error" not in p and r["text_sha1"] == p["text_sha1"])
        out["same_replica_as_pass1"] = sum(1 for r, p in zip(rows, pass1)
                                           if "error" not in r and "error" not in p and r["replica"] == p["replica"])
    if pass2 is not None:
        out["same_replica_as_pass2"] = sum(1 for r, p in zip(rows, pass2)
                                           if "error" not in r and "error" not in p and r["replica"] == p["replica"])
    for i, r in enumerate(rows):
        for key, earlier in (("replica_is_pass1s", pass1), ("replica_is_pass2s", pass2)):
            if earlier is not None:
                r[key] = r.get("replica") is not None and r.get("replica") == earlier[i].get("replica")
    return out


def run_shared_variant(record: dict, variant: str, args: argparse.Namespace, prompts: list[dict],
                       log_dir: str) -> None:
    extra = ["--suffix-share-interval", str(SHARE_INTERVAL_S)] + (["--no-share-suffix-cache"]
                                                                   if variant == "unshared" else [])
    record["command"] = server_command("ray_2", args, "PORT", extra)
    record["share_suffix_cache"] = variant == "shared"
    record["log"] = log_path = os.path.join(log_dir, f"shared_{variant}.log")
    record["passes"] = {}
    server = launch("ray_2", args, log_path, extra)
    record.update({"port": server.port, "startup_s": server.startup_s, "replicas": server.replicas})
    try:
        if len(server.replicas) < 2:
            raise RuntimeError(f"/health lists {len(server.replicas)} healthy replica(s): {server.health}")
        a, b = server.replicas[:2]
        record["replica_a"], record["replica_b"] = a, b
        work = prompts[:args.repeat_prompts]
        with client(args) as c:
            record["warmup_replicas"] = [chat(c, server.base, WARMUP_PROMPT, WARMUP_TOKENS, pin)["replica"]
                                         for pin in (a, b)]
            time.sleep(SHARE_WAIT_S)
            pass1 = run_pass(c, server.base, work, [a if i % 2 == 0 else b for i in range(len(work))], args.max_tokens)
            record["passes"]["1"] = summarize_pass(pass1, "alternately A, B", None, None)
            time.sleep(SHARE_WAIT_S)
            other = [b if (r.get("replica") or r["pin"]) == a else a for r in pass1]
            pass2 = run_pass(c, server.base, work, other, args.max_tokens)
            record["passes"]["2"] = summarize_pass(pass2, "the other replica than pass 1's", pass1, None)
            time.sleep(SHARE_WAIT_S)
            pass3 = run_pass(c, server.base, work, [None] * len(work), args.max_tokens)
            record["passes"]["3"] = summarize_pass(pass3, "none (prefix-affinity routing)", pass1, pass2)
        for key in ("1", "2", "3"):
            p = record["passes"][key]
            print(f"{variant:8s} pass {key}: drafts {p['num_drafts']:4d} accepted {p['num_accepted_tokens']:4d} | "
                  f"MAL {serve_bench.fmt(p['mean_acceptance_length'], '.2f')} | mean latency "
                  f"{serve_bench.fmt_ms(p['mean_latency_s'])} | errors {p['num_errors']}", file=sys.stderr, flush=True)
    finally:
        record["stop"] = stop(server)


def pass_ok(variants: dict, variant: str, key: str) -> dict | None:
    p = ((variants.get(variant) or {}).get("passes") or {}).get(key)
    return p if p and p["num_errors"] == 0 and p["num_ok"] else None


def shared_derived(variants: dict) -> dict:
    s2, u2 = pass_ok(variants, "shared", "2"), pass_ok(variants, "unshared", "2")
    out: dict = {
        "cross_replica_acceptance_gain": serve_bench.ratio(s2 and s2["mean_acceptance_length"],
                                                           u2 and u2["mean_acceptance_length"]),
        "pass2_latency_ratio": serve_bench.ratio(s2 and s2["mean_latency_s"], u2 and u2["mean_latency_s"]),
        "per_variant": {},
    }
    for variant in SHARED_VARIANTS:
        p1 = pass_ok(variants, variant, "1")
        if p1 is None:
            continue
        row = {}
        for key in ("2", "3"):
            p = pass_ok(variants, variant, key)
            row[f"pass{key}_over_pass1"] = {
                "mean_acceptance_length": serve_bench.ratio(p and p["mean_acceptance_length"],
                                                            p1["mean_acceptance_length"]),
                "mean_latency": serve_bench.ratio(p and p["mean_latency_s"], p1["mean_latency_s"])}
        out["per_variant"][variant] = row
    s1 = ((variants.get("shared") or {}).get("passes") or {}).get("1")
    u1 = ((variants.get("unshared") or {}).get("passes") or {}).get("1")
    if s1 and u1:
        out["pass1_same_text_across_variants"] = sum(
            1 for x, y in zip(s1["requests"], u1["requests"])
            if "error" not in x and "error" not in y and x["text_sha1"] == y["text_sha1"])
    return out


def shared_table(variants: dict) -> str:
    lines = ["| variant | pass | pin | requests | on pinned | replica = pass 1's | drafts | accepted | "
             "mean acc. length | mean latency | same text as pass 1 | errors |", "|---" * 12 + "|"]
    for variant, record in variants.items():
        if record.get("error") and not record.get("passes"):
            lines.append(f"| {variant} | failed: {record['error'].splitlines()[0][:100]} |")
            continue
        for key, p in (record.get("passes") or {}).items():
            lines.append(
                f"| {variant} | {key} | {p['pin']} | {p['num_requests']} | "
                f"{serve_bench.fmt(p['on_pinned_replica'], 'd')} | "
                f"{serve_bench.fmt(p.get('same_replica_as_pass1'), 'd')} | {p['num_drafts']} | "
                f"{p['num_accepted_tokens']} | {serve_bench.fmt(p['mean_acceptance_length'], '.2f')} | "
                f"{serve_bench.fmt_ms(p['mean_latency_s'])} | {serve_bench.fmt(p.get('same_text_as_pass1'), 'd')} | "
                f"{p['num_errors']} |")
        if record.get("error") and record.get("passes"):
            lines.append(f"| {variant} | failed: {record['error'].splitlines()[0][:100]} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", "--prompts", dest="questions", required=True,
                        help="Spec-Bench question.jsonl (e.g. ../shared/data/spec_bench/question.jsonl)")
    parser.add_argument("--python", default=os.path.join(REPO, ".venv", "bin", "python"),
                        help="Python of every server: specrs with its serve and ray extras (default this checkout's "
                             ".venv)")
    parser.add_argument("--model-path", default=None, help="GGUF every server loads (default SmolLM2-135M Q4_1)")
    parser.add_argument("--spec-config", default=DEFAULT_SPEC,
                        help=f"every server's --speculative-config (default {DEFAULT_SPEC})")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="every server's --max-num-seqs (default 4)")
    parser.add_argument("--concurrency", default="1,4", help="part A's client counts, comma-separated (default 1,4)")
    parser.add_argument("--requests-per-level", type=int, default=12, help="part A's requests per level (default 12)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    parser.add_argument("--repeat-prompts", type=int, default=8, help="part B's prompts (default 8)")
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--log-dir", default=None, help="server logs (default a new temporary directory)")
    parser.add_argument("--out", default=os.path.join("bench-results", "ray_bench.json"),
                        help="JSON output file (default bench-results/ray_bench.json)")
    args = parser.parse_args()

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"unknown or no part(s) {unknown}; choose from {PARTS}")
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error("--concurrency must be comma-separated integers")
    if not levels or min(levels) < 1:
        parser.error("--concurrency needs client counts of at least 1")
    try:
        spec = json.loads(args.spec_config)
    except ValueError as e:
        parser.error(f"--spec-config is not JSON: {e}")
    if not isinstance(spec, dict) or "method" not in spec:
        parser.error("--spec-config must be a JSON object with a method")
    args.spec_config = json.dumps(spec)
    if min(args.requests_per_level, args.repeat_prompts, args.max_tokens, args.max_num_seqs) < 1:
        parser.error("--requests-per-level, --repeat-prompts, --max-tokens and --max-num-seqs must be at least 1")
    prompts = serve_bench.load_questions(args.questions)
    most = max(args.requests_per_level if "overhead" in parts else 0, args.repeat_prompts if "shared" in parts else 0)
    if most > len(prompts):
        parser.error(f"{most} prompts needed, but {args.questions} has {len(prompts)}")
    if args.model_path is None:
        args.model_path = serve_bench.default_model_path(args.python)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="ray_bench_")
    os.makedirs(log_dir, exist_ok=True)

    atexit.register(stop_everything)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # leave through the finally blocks, which stop the servers
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))

    report: dict = {
        "benchmark": "ray_bench", "args": vars(args), "machine": serve_bench.machine_info(),
        "git": serve_bench.git_info(), "model_path": args.model_path, "speculative_config": spec,
        "log_dir": log_dir, "ray_env": RAY_ENV,
        "specrs": serve_bench.package_info(args.python, "specrs", "specrs"),
        "ray": serve_bench.package_info(args.python, "ray", "ray"),
        "definitions": {
            "startup_s": "server process started -> ready (single: /health 200; Ray app: /health status ok with "
                         "num_replicas_healthy >= its replicas)",
            "requests_per_s": "successful requests of the level / level wall time (first request sent -> last "
                              "response ended), warm-up excluded",
            "output_tokens_per_s": "completion tokens of all requests of the level / level wall time",
            "ttft_s": "per request, request sent -> first chunk with text, at the client; p50/p99 over requests",
            "itl_s": "per request, (last text chunk - first text chunk) / (tokens delivered after the first text "
                     "chunk); p50/p99 over requests",
            "mean_acceptance_length": "1 + summed num_accepted_tokens / summed num_drafts of usage.speculative",
            "acceptance_rate": "summed num_accepted_tokens / summed num_draft_tokens",
            "overhead.ratios": "ray_1 and ray_2 over single at the same level (requests/s, output tokens/s, TTFT "
                               "p50, ITL p50); null where either level had a failed request",
            "requests_per_replica": "change of specrs:request_success_total per replica over the level",
            "latency_s": "part B: request sent -> whole non-streamed response read, at the client",
            "cross_replica_acceptance_gain": "pass 2 mean acceptance length with the shared cache / without",
            "pass2_latency_ratio": "pass 2 mean request latency with the shared cache / without",
            "percentiles": "linear interpolation between closest ranks",
            "prompts": "Spec-Bench first turns, round-robin over categories in file order; part A sends the first "
                       "--requests-per-level, part B the first --repeat-prompts"},
        "prompts": [{key: p[key] for key in ("question_id", "category")} | {"chars": len(p["content"])}
                    for p in prompts[:most]],
    }
    failed: list[str] = []
    overhead: dict = {"configs": {}}
    shared: dict = {"share_interval_s": SHARE_INTERVAL_S, "wait_between_passes_s": SHARE_WAIT_S, "variants": {}}
    if "overhead" in parts:
        report["overhead"] = overhead
    if "shared" in parts:
        report["shared"] = shared
    try:
        if "overhead" in parts:
            for name in OVERHEAD_CONFIGS:
                print(f"--- overhead: {name}", file=sys.stderr, flush=True)
                record: dict = {}
                overhead["configs"][name] = record
                try:
                    run_overhead_config(record, name, args, prompts, levels, log_dir)
                except Exception as e:  # recorded; the other configurations still run
                    record["error"] = f"{type(e).__name__}: {e}"
                    print(f"{name} failed: {record['error']}", file=sys.stderr, flush=True)
                if record.get("error") or any("error" in row or row.get("num_errors")
                                              for row in (record.get("levels") or {}).values()):
                    failed.append(f"overhead/{name}")
        if "shared" in parts:
            for variant in SHARED_VARIANTS:
                print(f"--- shared suffix cache: {variant}", file=sys.stderr, flush=True)
                record = {}
                shared["variants"][variant] = record
                try:
                    run_shared_variant(record, variant, args, prompts, log_dir)
                except Exception as e:  # recorded; the other variant still runs
                    record["error"] = str(e) if isinstance(e, serve_bench.ServerFailed) else f"{type(e).__name__}: {e}"
                    print(f"{variant} failed: {record['error']}", file=sys.stderr, flush=True)
                if record.get("error") or any(p["num_errors"] for p in (record.get("passes") or {}).values()):
                    failed.append(f"shared/{variant}")
    finally:
        stop_everything()
        if "overhead" in parts:
            mark_same_text(overhead["configs"], levels)
            overhead["ratios"] = overhead_ratios(overhead["configs"], levels)
        if "shared" in parts:
            shared["derived"] = shared_derived(shared["variants"])
        if args.out:  # first, so nothing printed below can lose it
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
        if overhead["configs"]:
            print(overhead_table(overhead["configs"], levels, overhead["ratios"]), file=sys.stderr)
        if shared["variants"]:
            print(shared_table(shared["variants"]), file=sys.stderr)
            print(json.dumps(shared["derived"], indent=1), file=sys.stderr)
        if args.out:
            print(f"wrote {args.out}", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)} (see `error` in the JSON and the server logs in {log_dir})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
