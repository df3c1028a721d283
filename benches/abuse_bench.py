"""`specrs serve` under a bounded abuse loop: correctness under abuse, not timing.

200 mixed bad requests (malformed JSON, overflowing numbers, out-of-vocabulary token ids, oversized
and chunked oversized bodies, prompts over the context, refused fields and speculative configs,
clients that disconnect mid-stream, and injected Rust panics through the test-only panicking
proposer) are sent by 2 abuse clients while 4 good clients stream greedy chat requests. It reports:
- per kind of bad request, the HTTP statuses seen, and every status that was not the expected one
  (the only 500s expected are the injected panics);
- whether every good output is identical to the same request run alone on the same server before
  the abuse;
- the server process's resident memory (VmRSS) before and after the loop, which must stay within
  10% (the "before" is taken after a warm-up round of the same traffic with every kind once, so
  lazily built state is already there), and sampled every 25 bad requests to show the trend;
- /health afterwards and the server's `request_success_total{finished_reason="error"}`.

    python benches/abuse_bench.py --out bench-results/abuse_bench.json

The server runs in a child process (this script with --serve-child) so its memory is its own; it
serves the default model with ngram speculation by default and the panicking proposer as its
"custom" method. Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

import httpx

SERVER_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PANIC = {"method": "custom", "num_speculative_tokens": 2, "adaptive_draft_length": False}
BODY_LIMIT = 1024 * 1024
MODEL = "abuse-bench"
GOOD_MAX_TOKENS = 48
# Each good client's requests: (prompt, per-request speculation), so the good traffic covers the
# server default, no speculation, suffix decoding and a changed default.
GOOD_CLIENTS = [
    [("List the days of the week.", None), ("Name three primary colors.", False)],
    [("Write a haiku about autumn leaves.", {"method": "suffix", "num_speculative_tokens": 4}),
     ("Count from one to ten in words.", None)],
    [("Translate to French: good morning, my friend.", {"num_speculative_tokens": 2}),
     ("What is 12 times 12? Answer with a sentence.", False)],
    [("Repeat this sentence twice: the quick brown fox jumps over the lazy dog.", None),
     ("Explain in one sentence what a compiler does.", {"method": "suffix", "num_speculative_tokens": 4})],
]


def serve_child(port: int) -> None:
    import uvicorn

    import specrs
    from specrs import _specrs
    from specrs.serve import build_app

    engine = specrs.Engine(speculative_config=SERVER_SPEC, proposer=_specrs._testing_panicking_proposer(2))
    engine.generate(engine.tokenizer.encode("Hello"), specrs.SamplingParams(temperature=0, max_tokens=4))
    app = build_app(engine, MODEL, max_num_seqs=8, max_request_body_bytes=BODY_LIMIT)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def chat(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def stream_text(base: str, body: dict) -> tuple[int, str, bool]:
    """(status, streamed text, whether an error event came) of one streamed request."""
    texts, errored = [], False
    with httpx.stream("POST", f"{base}/v1/chat/completions" if "messages" in body else f"{base}/v1/completions",
                      json=body, timeout=600) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, "", False
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errored = True
            elif chunk["choices"]:
                choice = chunk["choices"][0]
                texts.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return 200, "".join(texts), errored


def abuse_kinds(vocab_size: int, bounded_configs: list[str]) -> dict:
    """name -> (function(base) -> observed status, expected status). A streamed request whose
    stream ends with an error event reports "200+error"."""
    def post(raw, path="/v1/chat/completions", **kw):
        def send(base):
            content = raw if isinstance(raw, (bytes, str)) else json.dumps(raw)
            return httpx.post(f"{base}{path}", content=content, headers={"Content-Type": "application/json"},
                              timeout=600, **kw).status_code
        return send

    with_field = lambda raw_field: json.dumps(chat("Hi", 4))[:-1] + ", " + raw_field + "}"  # noqa: E731
    big = json.dumps(chat("word " * (BODY_LIMIT // 3), 4)).encode()

    def chunked(base):
        def body():
            for i in range(0, len(big), 65536):
                yield big[i:i + 65536]
        return httpx.post(f"{base}/v1/completions", content=body(), headers={"Content-Type": "application/json"},
                          timeout=600).status_code

    def panic_stream(base):
        status, _, errored = stream_text(base, chat("Hi!", 32, stream=True, ignore_eos=True, speculative=PANIC))
        return "200+error" if status == 200 and errored else status

    def disconnect(base):
        with httpx.stream("POST", f"{base}/v1/completions", timeout=600,
                          json={"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 500,
                                "temperature": 0, "ignore_eos": True, "stream": True}) as response:
            status = response.status_code
            lines = response.iter_lines()
            for _ in range(3):
                next(lines, None)
        return status  # the client went away after three lines

    kinds = {
        "invalid_json": (post(b"{not json"), 400),
        "unknown_field": (post(chat("Hi", 4, frobnicate=1)), 400),
        "seed_2^64": (post(with_field(f'"seed": {2**64}')), 400),
        "top_k_2^63": (post(with_field(f'"top_k": {2**63}')), 400),
        "temperature_10^400": (post(with_field('"temperature": 1' + "0" * 400)), 400),
        "min_p_nan": (post(with_field('"min_p": NaN')), 400),
        "max_tokens_2^70": (post(with_field(f'"max_tokens": {2**70}')), 400),
        "max_tokens_negative": (post(chat("Hi", -5)), 400),
        "token_id_2^40": (post({"model": MODEL, "prompt": [1, 2**40], "max_tokens": 2}, "/v1/completions"), 400),
        "token_id_past_vocab": (post({"model": MODEL, "prompt": [vocab_size], "max_tokens": 2},
                                     "/v1/completions"), 400),
        "integer_of_5000_digits": (post(with_field('"seed": ' + "9" * 5000)), 400),
        "nesting_20000_deep": (post("[" * 20000 + "]" * 20000), 400),
        "body_over_limit": (post(big), 413),
        "chunked_body_over_limit": (chunked, 413),
        "prompt_over_context": (post({"model": MODEL, "prompt": "word " * 9000, "max_tokens": 4}, "/v1/completions"),
                                400),
        "n_2": (post(chat("Hi", 4, n=2)), 400),
        "continuous_usage_without_include_usage": (
            post(chat("Hi", 4, stream=True, stream_options={"continuous_usage_stats": True})), 400),
        "unknown_speculative_key": (post(chat("Hi", 4, speculative={"method": "ngram", "bogus": 1})), 400),
        "weights_per_request": (post(chat("Hi", 4, speculative={"method": "draft_model", "model": "/etc/passwd",
                                                                 "num_speculative_tokens": 2})), 400),
        "model_not_found": (post({**chat("Hi", 4), "model": "gpt-5"}), 404),
        "disconnect_mid_stream": (disconnect, 200),
        "injected_panic": (post(chat("Hi!", 32, ignore_eos=True, speculative=PANIC)), 500),
        "injected_panic_streamed": (panic_stream, "200+error"),
    }
    abusive = {
        "ngram_lookup_max_10^8": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 100000000,
                                  "num_speculative_tokens": 4},
        "suffix_depth_10^8": {"method": "suffix", "suffix_decoding_max_tree_depth": 100000000},
    }
    for name, config in abusive.items():
        if name in bounded_configs:  # only configs the engine refuses: others would allocate gigabytes
            kinds[name] = (post(chat("Hi", 4, speculative=config)), 400)
    return kinds


def bounded(names_configs: dict) -> list[str]:
    from specrs.engine import _config_json
    from specrs.errors import ConfigError

    out = []
    for name, config in names_configs.items():
        try:
            _config_json(config)
        except ConfigError:
            out.append(name)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-bad", type=int, default=200)
    parser.add_argument("--out", default=None, help="JSON output file")
    parser.add_argument("--serve-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_child is not None:
        serve_child(args.serve_child)
        return 0

    import specrs
    from specrs import bench

    vocab_size = specrs.Engine().tokenizer.vocab_size
    checked = bounded({
        "ngram_lookup_max_10^8": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 100000000,
                                  "num_speculative_tokens": 4},
        "suffix_depth_10^8": {"method": "suffix", "suffix_decoding_max_tree_depth": 100000000},
    })
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-child", str(port)])
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if child.poll() is not None or time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.3)
        report = run(base, child.pid, vocab_size, checked, args.num_bad)
    finally:
        child.terminate()
        child.wait(timeout=30)
    report["abusive_configs_skipped"] = [n for n in ("ngram_lookup_max_10^8", "suffix_depth_10^8") if n not in checked]
    print_summary(report)
    if args.out:
        bench.write_json(args.out, {"args": vars(args), "machine": bench.machine_info(), **report})
        print(f"wrote {args.out}", file=sys.stderr)
    ok = (report["unexpected"] == [] and report["good_identical"] == report["good_requests"]
          and report["rss_ratio"] <= 1.10 and report["health_after"] == 200)
    return 0 if ok else 1


def run(base: str, pid: int, vocab_size: int, checked: list[str], num_bad: int) -> dict:
    # Solo: each good request alone on the idle server.
    solo = {(prompt, json.dumps(spec)): stream_text(base, good_body(prompt, spec))[1]
            for client in GOOD_CLIENTS for prompt, spec in client}
    kinds = abuse_kinds(vocab_size, checked)
    # Warm-up: one short round of the same traffic (every kind once, the same client threads), so
    # lazily built state (worker threads, their allocator arenas, buffers) exists before the baseline.
    warm_up = abuse_round(base, pid, kinds, len(kinds), solo)
    rss_before = rss_bytes(pid)
    r = abuse_round(base, pid, kinds, num_bad, solo)
    time.sleep(1.0)  # the last disconnected streams are cancelled before their next step
    rss_after = rss_bytes(pid)
    health = httpx.get(f"{base}/health", timeout=10)
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    errors_metric = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                        if line.startswith("specrs:request_success_total{") and 'finished_reason="error"' in line)
    total = Counter()
    for counts in r["statuses"].values():
        total.update(counts)
    return {
        "num_bad_requests": sum(total.values()),
        "statuses": dict(sorted(total.items())),
        "statuses_per_kind": {name: dict(counts) for name, counts in sorted(r["statuses"].items())},
        "unexpected": warm_up["unexpected"] + r["unexpected"],
        "num_500_total": total.get("500", 0),
        "num_500_injected": r["statuses"]["injected_panic"].get("500", 0),
        "good_requests": len(r["good_runs"]) + len(warm_up["good_runs"]),
        "good_identical": sum(r["good_runs"]) + sum(warm_up["good_runs"]),
        "good_errors": warm_up["good_errors"] + r["good_errors"],
        "rss_before_bytes": rss_before,
        "rss_after_bytes": rss_after,
        "rss_ratio": rss_after / rss_before,
        "rss_samples_bytes": r["rss_samples"],  # every 25 bad requests during the loop
        "health_after": health.status_code,
        "server_finished_reason_error_total": errors_metric,
        "wall_s": r["wall_s"],
    }


def good_body(prompt: str, spec) -> dict:
    return chat(prompt, GOOD_MAX_TOKENS, stream=True, speculative=spec)


def abuse_round(base: str, pid: int, kinds: dict, num_bad: int, solo: dict) -> dict:
    """`num_bad` bad requests from 2 clients, cycling through `kinds`, while the 4 good clients
    stream their requests over and over (each at least once) until the bad ones are done."""
    statuses: dict[str, Counter] = defaultdict(Counter)
    unexpected: list[str] = []
    rss_samples: list[int] = []
    abuse_done = threading.Event()
    lock = threading.Lock()
    schedule = iter(list(itertools.islice(itertools.cycle(kinds), num_bad)))
    sent = itertools.count(1)

    def abuser():
        while True:
            with lock:
                name = next(schedule, None)
            if name is None:
                return
            send, expected = kinds[name]
            try:
                status = send(base)
            except Exception as e:  # a dropped connection is a finding too
                status = f"exception {type(e).__name__}"
            with lock:
                statuses[name][str(status)] += 1
                if status != expected:
                    unexpected.append(f"{name}: {status} (expected {expected})")
                if next(sent) % 25 == 0:
                    rss_samples.append(rss_bytes(pid))

    good_runs: list[bool] = []
    good_errors: list[str] = []

    def good_client(requests):
        rounds = 0
        while rounds == 0 or not abuse_done.is_set():
            for prompt, spec in requests:
                status, text, errored = stream_text(base, good_body(prompt, spec))
                with lock:
                    good_runs.append(status == 200 and not errored and text == solo[(prompt, json.dumps(spec))])
                    if status != 200 or errored:
                        good_errors.append(f"{prompt!r}: status {status}, error event {errored}")
            rounds += 1

    goods = [threading.Thread(target=good_client, args=(c,)) for c in GOOD_CLIENTS]
    abusers = [threading.Thread(target=abuser) for _ in range(2)]
    t0 = time.perf_counter()
    for t in goods + abusers:
        t.start()
    for t in abusers:
        t.join()
    abuse_done.set()
    for t in goods:
        t.join()
    return {"statuses": statuses, "unexpected": unexpected, "good_runs": good_runs, "good_errors": good_errors,
            "rss_samples": rss_samples, "wall_s": time.perf_counter() - t0}


def print_summary(r: dict) -> None:
    print(f"bad requests: {r['num_bad_requests']} | statuses {r['statuses']}")
    print(f"500s: {r['num_500_total']} ({r['num_500_injected']} injected panics); streamed injected panics end "
          f"with an error event: {r['statuses_per_kind'].get('injected_panic_streamed', {})}")
    print(f"unexpected statuses: {r['unexpected'] or 'none'}")
    print(f"good streams: {r['good_identical']}/{r['good_requests']} identical to their solo runs"
          + (f" | errors: {r['good_errors']}" if r["good_errors"] else ""))
    print(f"server RSS: {r['rss_before_bytes'] / 2**20:.1f} MiB before, {r['rss_after_bytes'] / 2**20:.1f} MiB after "
          f"({(r['rss_ratio'] - 1) * 100:+.1f}%); during the loop: "
          f"{' '.join(f'{b / 2**20:.0f}' for b in r['rss_samples_bytes'])} MiB | /health after: {r['health_after']} | "
          f"finished_reason=error total: {r['server_finished_reason_error_total']:.0f}")
    if r.get("abusive_configs_skipped"):
        print(f"skipped (the engine accepts them, so they would allocate gigabytes): {r['abusive_configs_skipped']}")


if __name__ == "__main__":
    sys.exit(main())
