"""First-request benchmark: how long from `Engine(model, speculative_config=...)` (`api`), or
from starting `specrs serve` (`serve`), to the first token of the first request (issue 39 item 3:
no silent waits, a few seconds at most before the first token).

Each run is a fresh process, for each of
- cache `cold` (an empty `$SPECRS_CACHE_DIR`) and `warm` (a directory a priming process filled:
  it built the engine, ran one request and waited for its cost measurements where the engine has
  `wait_for_costs`; before the background cost thread, building the engine measured them);
- load `quiet` and, with `--busy`, `busy` (one busy-loop process per core, `os.cpu_count()`,
  running beside it: what a laptop or a shared CI machine looks like).
Each cell is `--runs` processes (default 3): min, median and max seconds, with what the engine
says it measured in the foreground by the first token (`cost_status()`, or the server's
`specrs:cost_measurements{thread="foreground"}`), the first request's cost source and
`idle_reason`, and the server's startup log lines. `serve` reads the first token from a streamed
chat completion sent as soon as /health answers.

It runs on older specrs too (no `cost_status`: those fields are null), so the same script gives
the before and after of a change. After `make build`:

    .venv/bin/python benches/first_request_bench.py --busy --out bench-results/first_request.json
    .venv/bin/python benches/first_request_bench.py --modes api --caches cold --runs 1   # a smoke run

(Until issue 39 this script measured whether the first speculative request paid the cost
measurements inside its own latency; that version is at commit eedf5da, its results in
benches/README.md. The background cost thread took the measurements out of every request.)

Output: a table on stdout and, with `--out`, JSON: {"settings", "machine", "specrs", "commit",
"first_token": {"<mode>/<cache>/<load>": {"seconds": [...], "min", "median", "max", "runs": [...]}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

DEFAULT_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PROMPT = "Repeat this list twice: red, green, blue, yellow, purple, orange."


# --- the child processes -----------------------------------------------------------------------


def child_api(config: dict, max_tokens: int) -> dict:
    """One process: Engine(...) to the first streamed token; prints the JSON result."""
    start = time.perf_counter()
    import specrs

    engine = specrs.Engine(speculative_config=config)
    built_s = time.perf_counter() - start
    stream = engine.stream([{"role": "user", "content": PROMPT}], specrs.SamplingParams(temperature=0, max_tokens=max_tokens))
    first_s = None
    status_at_first = None
    for chunk in stream:
        if first_s is None and chunk:
            first_s = time.perf_counter() - start
            status_at_first = engine.cost_status() if hasattr(engine, "cost_status") else None
    metrics = stream.result.metrics
    return {"first_token_s": first_s, "engine_built_s": built_s,
            "foreground_measurements_at_first_token":
                None if status_at_first is None else status_at_first["num_foreground_measurements"],
            "verify_cost_source": metrics.get("verify_cost_source"), "num_drafts": metrics.get("num_drafts"),
            "idle_reason": metrics.get("idle_reason")}


def child_prime(config: dict) -> dict:
    """Fills the cache directory: builds the engine, runs one request, waits for its measurements."""
    import specrs

    engine = specrs.Engine(speculative_config=config)
    engine.generate(PROMPT, specrs.SamplingParams(temperature=0, max_tokens=8))
    waited = engine.wait_for_costs() if hasattr(engine, "wait_for_costs") else None
    return {"waited_for_costs": waited}


# --- helpers -----------------------------------------------------------------------------------


@contextmanager
def busy_loops(enabled: bool):
    """One busy-loop process per core while the block runs."""
    procs = []
    if enabled:
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def run_child(kind: str, config: dict, max_tokens: int, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--config", json.dumps(config), "--max-tokens", str(max_tokens)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the {kind} child failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_first_token(config: dict, max_tokens: int, env: dict, log_dir: Path) -> dict:
    """Starts `specrs serve`, sends one streamed chat completion as soon as /health answers, and
    returns the time from the start of the process to its first content token."""
    import httpx

    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specrs.cli", "serve", "--port", str(port),
                                 "--speculative-config", json.dumps(config), "--log-level", "warning"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"specrs serve exited:\n{log_path.read_text()}")
                time.sleep(0.05)
            ready_s = time.perf_counter() - start
            body = {"model": httpx.get(f"{base}/v1/models").json()["data"][0]["id"],
                    "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "stream": True}
            first_s, metrics_at_first = None, None
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    choices = chunk.get("choices") or []
                    if first_s is None and choices and (choices[0].get("delta") or {}).get("content"):
                        first_s = time.perf_counter() - start
                        metrics_at_first = httpx.get(f"{base}/metrics").text
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    foreground = None
    for line in (metrics_at_first or "").splitlines():
        if line.startswith("specrs:cost_measurements{") and 'thread="foreground"' in line:
            foreground = float(line.rsplit(" ", 1)[1])
    startup_log = [line for line in log_path.read_text().splitlines() if line.startswith("specrs")]
    return {"first_token_s": first_s, "ready_s": ready_s, "foreground_measurements_at_first_token": foreground,
            "startup_log": startup_log}


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"min": None, "median": None, "max": None}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def write_report(out: str | None, settings: dict, results: dict) -> None:
    """The run's settings, machine, specrs version and commit beside `results`, as JSON at `out`
    (None: nothing written)."""
    import specrs

    report = {"settings": settings, "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                                                "python": platform.python_version()},
              "specrs": specrs.__version__, "commit": commit(), **results}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
        print(f"wrote {out}", file=sys.stderr)


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# --- the measurement ---------------------------------------------------------------------------


def one_first_token(mode: str, config: dict, max_tokens: int, env: dict) -> dict:
    if mode == "api":
        return run_child("api", config, max_tokens, env)
    with tempfile.TemporaryDirectory() as log_dir:
        return serve_first_token(config, max_tokens, env, Path(log_dir))


def first_token(args, config: dict) -> dict:
    results = {}
    loads = ["quiet", "busy"] if args.busy else ["quiet"]
    with tempfile.TemporaryDirectory() as warm_dir:
        warm_env = dict(os.environ, SPECRS_CACHE_DIR=warm_dir)
        if "warm" in args.caches:  # primed once, quiet, before the cells that read it
            run_child("prime", config, args.max_tokens, warm_env)
        for mode in args.modes:
            for load in loads:
                for cache in args.caches:
                    runs = []
                    with busy_loops(load == "busy"):
                        for _ in range(args.runs):
                            if cache == "warm":
                                runs.append(one_first_token(mode, config, args.max_tokens, warm_env))
                            else:
                                with tempfile.TemporaryDirectory() as cold_dir:
                                    env = dict(os.environ, SPECRS_CACHE_DIR=cold_dir)
                                    runs.append(one_first_token(mode, config, args.max_tokens, env))
                    key = f"{mode}/{cache}/{load}"
                    seconds = [r["first_token_s"] for r in runs]
                    results[key] = {"seconds": seconds, **spread(seconds), "runs": runs}
                    s = results[key]
                    foreground = [r.get("foreground_measurements_at_first_token") for r in runs]
                    print(f"{key:<22} first token {s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f} s "
                          f"(min / median / max of {len(runs)}); foreground cost measurements by then: {foreground}",
                          flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["api", "serve"], choices=["api", "serve"])
    ap.add_argument("--caches", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    ap.add_argument("--busy", action="store_true", help="each cell beside a busy loop on every core too")
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per cell")
    ap.add_argument("--config", default=json.dumps(DEFAULT_CONFIG), help="the speculative config (JSON)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens of the first request")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--child", choices=["api", "prime"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    config = json.loads(args.config)
    if args.child == "api":
        print(json.dumps(child_api(config, args.max_tokens)))
        return 0
    if args.child == "prime":
        print(json.dumps(child_prime(config)))
        return 0
    if args.runs < 1:
        ap.error("--runs must be at least 1")

    settings = {k: v for k, v in vars(args).items() if k != "child"}
    write_report(args.out, settings, {"first_token": first_token(args, config)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
