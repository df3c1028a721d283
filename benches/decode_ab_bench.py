"""Single-request plain decoding, two builds of specrs side by side: tokens/s of the same greedy
request (speculation off) with build A and with build B, in turn (A B A B ...), each run in a
fresh process. Used to check that a change to the model layer costs no decode speed.

    python benches/decode_ab_bench.py --a-wheel OLD.whl [--b-wheel NEW.whl] [--rounds 5] [--out ab.json]
        [--model qwen2.5-coder-1.5b ...]   # default: smollm2-135m and gemma3-270m
        [--batch 16 --speculative '{"method": "ngram", "num_speculative_tokens": 4}']
        [--b-engine '{"kv_layout": "paged"}']   # Engine keyword arguments of one side

With `--batch N`, N requests (the prompt, numbered) go through one batched `Engine.generate`
(the scheduler), optionally speculative; the figure is then all their tokens over the call's
wall time (prefill included), for changes to the step driver.

Each wheel is installed (no dependencies) into its own directory under --work and put first on
PYTHONPATH; without --b-wheel, B is the specrs this Python imports. Figures: decode tokens/s
(`metrics["decode_tokens_per_s"]`, prefill excluded) per model, the median of the rounds, and
the median of the per-round ratios B/A.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = ["smollm2-135m", "gemma3-270m"]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
WORKER = """
import json, sys, time, specrs
engine = specrs.Engine(sys.argv[1], **json.loads(sys.argv[6]))
batch, spec = int(sys.argv[4]), json.loads(sys.argv[5])
params = specrs.SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True)
engine.generate(sys.argv[2], specrs.SamplingParams(temperature=0, max_tokens=8), speculative_config=spec)  # warm-up
if batch == 1:
    out = engine.generate(sys.argv[2], params, speculative_config=spec)
    print(json.dumps({"decode_tokens_per_s": out.metrics["decode_tokens_per_s"], "tokens": out.token_ids}))
else:
    prompts = [f"{sys.argv[2]} ({i + 1})" for i in range(batch)]
    start = time.perf_counter()
    outs = engine.generate(prompts, params, speculative_config=spec)
    wall = time.perf_counter() - start
    tokens = [o.token_ids for o in outs]
    print(json.dumps({"decode_tokens_per_s": sum(map(len, tokens)) / wall, "tokens": tokens}))
"""


def install(wheel: str, into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(into), wheel], check=True
    )
    return into


def run(site: Path | None, model: str, max_tokens: int, batch: int, speculative: str, engine: str) -> dict:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = str(site) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", WORKER, model, PROMPT, str(max_tokens), str(batch), speculative, engine],
        env=env, check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-wheel", required=True, help="build A (the baseline)")
    parser.add_argument("--b-wheel", help="build B (default: the specrs this Python imports)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--work", default=tempfile.gettempdir() + "/specrs-ab")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--numerics-change", action="store_true",
                        help="the builds round differently on purpose (e.g. SPECRS_CPU_KERNELS=avx2 across the AVX2 "
                             "tile kernel): report where their tokens part instead of stopping")
    parser.add_argument("--model", action="append", help=f"a model name or path (repeatable; default {MODELS})")
    parser.add_argument("--batch", type=int, default=1, help="requests in one batched generate (default 1)")
    parser.add_argument("--speculative", default="false", help="speculative config JSON (default false: off)")
    parser.add_argument("--a-engine", default="{}", help="Engine keyword arguments of build A, JSON (default none)")
    parser.add_argument("--b-engine", default="{}", help="Engine keyword arguments of build B, JSON (e.g. "
                        "'{\"kv_layout\": \"paged\"}': the same wheel as A with another KV layout)")
    args = parser.parse_args()
    work = Path(args.work)
    site_a = install(args.a_wheel, work / "a")
    site_b = install(args.b_wheel, work / "b") if args.b_wheel else None
    results = {}
    for model in args.model or MODELS:
        a, b, ratios = [], [], []
        for _ in range(args.rounds):
            ra = run(site_a, model, args.max_tokens, args.batch, args.speculative, args.a_engine)
            rb = run(site_b, model, args.max_tokens, args.batch, args.speculative, args.b_engine)
            if ra["tokens"] != rb["tokens"]:
                if not args.numerics_change:
                    raise SystemExit(f"{model}: the two builds decoded different tokens")
                parted = next(i for i, (x, y) in enumerate(zip(ra["tokens"] + [None], rb["tokens"] + [-1])) if x != y)
                print(f"{model}: the builds' greedy tokens part at token {parted} (--numerics-change)")
            a.append(ra["decode_tokens_per_s"])
            b.append(rb["decode_tokens_per_s"])
            ratios.append(rb["decode_tokens_per_s"] / ra["decode_tokens_per_s"])
        results[model] = {
            "a_tokens_per_s": statistics.median(a),
            "b_tokens_per_s": statistics.median(b),
            "b_over_a": statistics.median(ratios),
            "b_over_a_min_max": [min(ratios), max(ratios)],
        }
        print(f"{model}: A {results[model]['a_tokens_per_s']:.1f} tok/s, B {results[model]['b_tokens_per_s']:.1f} "
              f"tok/s, B/A {results[model]['b_over_a']:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if args.out:
        report = {"rounds": args.rounds, "max_tokens": args.max_tokens, "batch": args.batch,
                  "speculative": json.loads(args.speculative), "a_engine": json.loads(args.a_engine),
                  "b_engine": json.loads(args.b_engine), "results": results}
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
