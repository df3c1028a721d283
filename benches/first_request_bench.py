"""First-request benchmark: does a user's first speculative request pay the one-time cost
measurements (verification cost curve, draft cost, a quantized_self draft's requantization)
inside its own latency?

Three ways to reach the same first request, each in a fresh process:
- `on_demand`: `Engine(model)` with no config; the first request names the config, so its costs
  are measured inside that request (what every first request paid before `Engine.prepare`);
- `prepared`: `Engine(model, speculative_config=cfg)` measures them when the Engine is built;
- `cached`: the same, in a later process sharing `prepared`'s cache directory, which reads them
  from `$SPECRS_CACHE_DIR/costs/`.

`on_demand` and `prepared` start from an empty cache directory. Every process first runs one
unrelated plain request (the process's own warm-up, the same in every mode), then per prompt a
plain request and the speculative one, alternating which goes first. The figure is the speedup,
plain time over speculative time, of the first prompt and over all prompts, beside the build time.

Usage (after `make build`):
    .venv/bin/python benches/first_request_bench.py --spec-bench ../shared/data/spec_bench/question.jsonl \
        --out bench-results/first_request.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import specrs

MODES = ["on_demand", "prepared", "cached"]
CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "layer_skip": {"method": "layer_skip", "exit_layer": 8, "num_speculative_tokens": 4},
    "quantized_self": {"method": "quantized_self", "num_speculative_tokens": 4},
}
WARM_UP_PROMPT = "Name three colours."


def child(mode: str, method: str, prompts: list[str], max_tokens: int) -> dict:
    """One process's measurements (SPECRS_CACHE_DIR is set by the parent)."""
    cfg = CONFIGS[method]
    params = specrs.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine = specrs.Engine() if mode == "on_demand" else specrs.Engine(speculative_config=cfg)
    build_s = time.perf_counter() - start
    engine.generate(WARM_UP_PROMPT, params, speculative_config=False)
    rows = []
    for i, prompt in enumerate(prompts):
        times, cost_sources = {}, None
        order = ["plain", "spec"] if i % 2 else ["spec", "plain"]  # the first prompt: speculation first
        for which in order:
            t0 = time.perf_counter()
            if which == "plain":
                engine.generate(prompt, params, speculative_config=False)
            else:
                out = engine.generate(prompt, params, speculative_config=cfg)
                cost_sources = (out.metrics.get("verify_cost_source"), out.metrics.get("draft_cost_source"))
            times[which] = time.perf_counter() - t0
        rows.append({"plain_s": times["plain"], "spec_s": times["spec"], "cost_sources": cost_sources})
    return {"build_s": build_s, "rows": rows}


def run_child(mode: str, method: str, cache_dir: str, args) -> dict:
    env = dict(os.environ, SPECRS_CACHE_DIR=cache_dir)
    cmd = [sys.executable, __file__, "--child", mode, method, "--spec-bench", args.spec_bench,
           "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def select_prompts(path: str, count: int) -> list[str]:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    return [r["turns"][0] for r in rows if r["category"] == "summarization"][:count]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec-bench", required=True, help="Spec-Bench question.jsonl")
    ap.add_argument("--methods", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--prompts", type=int, default=3, help="summarization prompts per process")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    prompts = select_prompts(args.spec_bench, args.prompts)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], prompts, args.max_tokens)))
        return 0

    results = {}
    print(f"{'method':<15}{'mode':<11}{'build s':>9}{'first x':>9}{'all x':>8}  first request's cost sources")
    for method in args.methods:
        with tempfile.TemporaryDirectory() as on_demand_dir, tempfile.TemporaryDirectory() as prepared_dir:
            dirs = {"on_demand": on_demand_dir, "prepared": prepared_dir, "cached": prepared_dir}
            for mode in MODES:
                r = run_child(mode, method, dirs[mode], args)
                first = r["rows"][0]
                r["first_speedup"] = first["plain_s"] / first["spec_s"]
                r["speedup"] = sum(x["plain_s"] for x in r["rows"]) / sum(x["spec_s"] for x in r["rows"])
                results[f"{method}/{mode}"] = r
                print(f"{method:<15}{mode:<11}{r['build_s']:>9.2f}{r['first_speedup']:>8.2f}x"
                      f"{r['speedup']:>7.2f}x  {first['cost_sources']}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"prompts": args.prompts, "max_tokens": args.max_tokens, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
