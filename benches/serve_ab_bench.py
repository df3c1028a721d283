"""`specrs serve` under 16 concurrent streaming clients, two or more builds (or settings) side by
side: the server's output tokens/s with variant A, B, ... in turn (A B ... A B ...), each round a
fresh server process per variant. Used to check that a change to the engine's core (the step
driver, the KV layout) costs no serving throughput.

    .venv/bin/python benches/serve_ab_bench.py --questions ../shared/data/spec_bench/question.jsonl \\
        --variant old:OLD.whl --variant new:NEW.whl --variant new_paged:NEW.whl:"--kv-layout paged" \\
        [--rounds 5] [--clients 16] [--requests 32] [--max-tokens 64] [--out ab.json]

A variant is `NAME:WHEEL[:EXTRA SERVE FLAGS]`; each wheel is installed (no dependencies) into its
own directory under --work and put first on PYTHONPATH of `--python` (which brings the serve
extra's packages). Every server loads the same GGUF (`--model-path`, default SmolLM2-135M Q4_1),
serves with `--speculative-config` (default ngram k = 4, the serve benchmark's) and the default
load budget, and gets one excluded warm-up request, then `--clients` closed-loop clients over the
first `--requests` Spec-Bench first turns (serve_bench.py's workload and client, greedy,
streamed). Figures: output tokens/s per variant (median over rounds) and the per-round ratio of
each variant over the first, as median (min-max, n); `same_text` counts requests whose text
equals the first variant's in the same round (greedy: all of them, unless a change alters
numerics).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_bench as sb  # noqa: E402  (the same servers, workload and client)
from decode_ab_bench import install  # noqa: E402


def parse_variant(text: str) -> dict:
    name, sep, rest = text.partition(":")
    wheel, _, extra = rest.partition(":")
    if not sep or not name or not wheel:
        raise SystemExit(f"--variant {text!r}: expected NAME:WHEEL[:EXTRA SERVE FLAGS]")
    return {"name": name, "wheel": wheel, "extra": extra.split()}


def run_variant(variant: dict, site: str, args: argparse.Namespace, prompts: list[dict], log_dir: str,
                round_index: int) -> dict:
    port = sb.free_port()
    command = [args.python, "-m", "specrs.cli", "serve", args.model_path, "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", str(args.clients), "--log-level", "warning", "--speculative-config",
               args.spec_config, *variant["extra"]]
    env_before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = site  # the server inherits it: this variant's specrs first
    try:
        log_path = os.path.join(log_dir, f"{variant['name']}-{round_index}.log")
        proc = sb.start_server(command, port, "/health", log_path, args.startup_timeout)
    finally:
        if env_before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = env_before
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=args.request_timeout) as client:
            sb.stream_one(client, base, sb.WARMUP_PROMPT, 8, True, {})
        level = sb.run_level(base, prompts, args.clients, args, True, {})
    finally:
        sb.stop_server(proc)
    return level


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, help="NAME:WHEEL[:EXTRA SERVE FLAGS]")
    parser.add_argument("--questions", "--prompts", dest="questions", required=True, help="Spec-Bench question.jsonl")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32, help="requests per round (the first N prompts)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--spec-config", default=sb.DEFAULT_SPEC)
    parser.add_argument("--python", default=os.path.join(sb.REPO, ".venv", "bin", "python"))
    parser.add_argument("--model-path", default=None, help="GGUF every server loads (default SmolLM2-135M Q4_1)")
    parser.add_argument("--work", default=tempfile.gettempdir() + "/specrs-serve-ab")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=1800)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    if len({v["name"] for v in variants}) != len(variants) or len(variants) < 2:
        raise SystemExit("give two or more --variant with distinct names")
    args.model_path = args.model_path or sb.default_model_path(args.python)
    prompts = sb.load_questions(args.questions)[: args.requests]
    sites = {}
    for v in variants:
        if v["wheel"] not in sites:
            sites[v["wheel"]] = str(install(v["wheel"], os.path.join(args.work, f"site{len(sites)}")))
    log_dir = tempfile.mkdtemp(prefix="serve-ab-logs-")
    rounds: list[dict] = []
    for r in range(args.rounds):
        levels = {v["name"]: run_variant(v, sites[v["wheel"]], args, prompts, log_dir, r) for v in variants}
        first = levels[variants[0]["name"]]
        row = {}
        for name, level in levels.items():
            same = sum(a.get("text_sha1") == b.get("text_sha1") for a, b in zip(first["requests"], level["requests"]))
            row[name] = {"output_tokens_per_s": level["output_tokens_per_s"], "num_errors": level["num_errors"],
                         "errors": level["errors"], "same_text": same, "completion_tokens": level["completion_tokens"],
                         "speculative": level["speculative"]}
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{n} {x['output_tokens_per_s'] or 0:.1f} tok/s" for n, x in row.items()),
              file=sys.stderr, flush=True)
    base = variants[0]["name"]
    summary = {}
    for v in variants:
        name = v["name"]
        tps = [row[name]["output_tokens_per_s"] for row in rounds if row[name]["output_tokens_per_s"]]
        ratios = [row[name]["output_tokens_per_s"] / row[base]["output_tokens_per_s"] for row in rounds
                  if row[name]["output_tokens_per_s"] and row[base]["output_tokens_per_s"]]
        summary[name] = {"wheel": v["wheel"], "extra": v["extra"], "output_tokens_per_s": spread(tps) if tps else None,
                         f"ratio_over_{base}": spread(ratios) if ratios else None,
                         "num_errors": sum(row[name]["num_errors"] for row in rounds),
                         "same_text": sum(row[name]["same_text"] for row in rounds),
                         "num_requests": len(prompts) * len(rounds)}
    result = {"settings": {k: v for k, v in vars(args).items() if k != "variant"}, "variants": variants,
              "summary": summary, "rounds": rounds, "machine": sb.machine_info(), "git": sb.git_info()}
    for name, s in summary.items():
        r = s[f"ratio_over_{base}"]
        t = s["output_tokens_per_s"]
        print(f"{name:>16}: {t['median'] if t else float('nan'):7.1f} tok/s  x{r['median']:.3f} "
              f"({r['min']:.3f}-{r['max']:.3f}, n={r['n']}) over {base}; errors {s['num_errors']}, "
              f"same text {s['same_text']}/{s['num_requests']}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
