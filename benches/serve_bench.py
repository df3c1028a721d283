"""`specrs serve` under load: TTFT and ITL (p50, p99) at 1, 4 and 16 concurrent streaming clients,
with and without speculation, on Spec-Bench prompts (the workload of benches/spec_bench.py: chat
template, greedy, 128 tokens, prompts cut to fit 2048 tokens).

One server process; every request says its own speculation (`"speculative": false` for the
baseline), so all modes share the server and its warm caches. For each concurrency level the modes
run one after another on the same prompts, in an order rotated per level. Each client takes the
next prompt from a shared list and streams it (`/v1/completions` with the prompt's token ids);
times are taken at the client:
- TTFT: request sent -> first chunk with text (queue time included);
- ITL: gap between consecutive chunks (a speculative step delivers several tokens in one chunk);
- TPOT: (e2e - TTFT) / (tokens - 1) per request, the per-token cost a reader sees;
- output tokens/s: all tokens over the wall time of the level (the server's throughput).

    python benches/serve_bench.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --out bench-results/serve_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

import specrs
from specrs import bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_bench import select_prompts  # noqa: E402

DEFAULT_CONFIGS = [
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}',
    '{"method": "suffix", "num_speculative_tokens": 4}',
]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def stream_one(base: str, prompt_ids: list[int], max_tokens: int, speculative) -> dict:
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "speculative": speculative}
    t0 = time.perf_counter()
    chunk_times, usage, text = [], None, []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=3600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
                text.append(chunk["choices"][0]["text"])
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    n = usage["completion_tokens"]
    ttft = chunk_times[0] - t0 if chunk_times else None
    return {
        "ttft_s": ttft,
        "itls_s": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
        "tpot_s": (end - chunk_times[0]) / (n - 1) if chunk_times and n > 1 else None,
        "e2e_s": end - t0,
        "num_tokens": n,
        "text": "".join(text),
        "speculative": usage.get("speculative"),
    }


def run_level(base: str, prompts: list[dict], concurrency: int, max_tokens: int, speculative) -> dict:
    results: list[dict | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))
    lock = threading.Lock()
    errors = []

    def client():
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            try:
                results[i] = stream_one(base, prompts[i]["token_ids"], max_tokens, speculative)
            except Exception as e:  # reported after the level
                errors.append(f"prompt {i}: {e!r}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors))
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    itls = [g for r in results for g in r["itls_s"]]
    tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    tokens = sum(r["num_tokens"] for r in results)
    drafts = sum((r["speculative"] or {}).get("num_drafts", 0) for r in results)
    accepted = sum((r["speculative"] or {}).get("num_accepted_tokens", 0) for r in results)
    return {
        "concurrency": concurrency,
        "num_requests": len(results),
        "ttft_s_p50": percentile(ttfts, 0.50), "ttft_s_p99": percentile(ttfts, 0.99),
        "itl_s_p50": percentile(itls, 0.50), "itl_s_p99": percentile(itls, 0.99),
        "tpot_s_mean": statistics.mean(tpots) if tpots else None,
        "output_tokens_per_s": tokens / wall,
        "wall_s": wall,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "texts": [r["text"] for r in results],
    }


def start_server(port: int, max_num_seqs: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "specrs.cli", "serve", "--port", str(port), "--max-num-seqs",
                             str(max_num_seqs), "--log-level", "warning"])
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("specrs serve did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True, help="Spec-Bench question.jsonl")
    parser.add_argument("--num-per-category", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--config", action="append", default=None, metavar="JSON",
                        help="a speculative config to compare with no speculation (repeatable; default ngram k=4 "
                             "and suffix k=4)")
    parser.add_argument("--out", default=None, help="JSON output file")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = [("baseline", False)] + [(bench.config_label(json.loads(c)), json.loads(c))
                                     for c in (args.config or DEFAULT_CONFIGS)]

    engine = specrs.Engine()  # tokenizes and cuts the prompts exactly as benches/spec_bench.py does
    prompts = bench.tokenize_prompts(engine, select_prompts(args.prompts, args.num_per_category, "spread"),
                                     args.max_tokens, chat=True)
    del engine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    rows = []
    for li, level in enumerate(levels):
        # A fresh server per level: suffix decoding caches every answer, and must not have seen
        # these prompts answered at the previous level.
        server = start_server(port, level)
        try:
            # Warm-up: every mode once (loads pages, measures the adaptive policy's costs).
            for _, speculative in modes:
                stream_one(base, prompts[0]["token_ids"][:16], 8, speculative)
            shift = li % len(modes)
            for label, speculative in modes[shift:] + modes[:shift]:
                row = run_level(base, prompts, level, args.max_tokens, speculative)
                row["mode"] = label
                rows.append(row)
                print(f"c={level:2d} {label:32s} TTFT p50 {row['ttft_s_p50'] * 1e3:7.0f} ms p99 "
                      f"{row['ttft_s_p99'] * 1e3:7.0f} ms | ITL p50 {row['itl_s_p50'] * 1e3:5.1f} ms p99 "
                      f"{row['itl_s_p99'] * 1e3:6.1f} ms | TPOT {row['tpot_s_mean'] * 1e3:5.1f} ms | "
                      f"{row['output_tokens_per_s']:5.1f} tok/s", file=sys.stderr, flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)

    # Greedy: every mode at every level must give the baseline's text for each prompt.
    reference = next(r["texts"] for r in rows if r["mode"] == "baseline")
    for row in rows:
        row["num_matching_baseline"] = sum(a == b for a, b in zip(row.pop("texts"), reference))
    lines = ["| clients | mode | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT mean | tok/s | vs baseline | "
             "mean acc. len | same text |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        base_row = next(r for r in rows if r["concurrency"] == row["concurrency"] and r["mode"] == "baseline")
        row["throughput_vs_baseline"] = row["output_tokens_per_s"] / base_row["output_tokens_per_s"]
        lines.append(
            f"| {row['concurrency']} | {row['mode']} | {row['ttft_s_p50'] * 1e3:.0f} ms | {row['ttft_s_p99'] * 1e3:.0f} ms | "
            f"{row['itl_s_p50'] * 1e3:.1f} ms | {row['itl_s_p99'] * 1e3:.1f} ms | {row['tpot_s_mean'] * 1e3:.1f} ms | "
            f"{row['output_tokens_per_s']:.1f} | {row['throughput_vs_baseline']:.2f}x | "
            f"{bench.fmt(row['mean_acceptance_length'], '.2f')} | {row['num_matching_baseline']}/{row['num_requests']} |")
    print("\n".join(lines))
    if args.out:
        bench.write_json(args.out, {"args": vars(args), "machine": bench.machine_info(),
                                    "num_prompts": len(prompts), "rows": rows})
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
