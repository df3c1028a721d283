"""Draft-model chains drafted together across a batch (issue 41 item 4): B requests with a draft
model run through one scheduler, their chains drafted in shared draft forwards (one per depth for
the whole batch: `proposer/chains_together.rs`) against the same scheduler with each request's
chain drafted alone (`draft_chains_together=False`), and plain batched decoding, in one process,
modes interleaved per repeat (their order rotated), greedy.

Workload: the first prompt of each category of `--prompts` (benches/code_workload.jsonl by
default), chat-templated, the first B of them per batch; `--max-tokens` each. The draft runs a
fixed `--k` (no adaptive length, so both modes draft the same chains and verify the same rows).

Figures per batch size and mode: wall seconds from the first step to the last (prefill included),
generated tokens/s over it, scheduler steps, chains drafted together and the draft forwards they
took; the ratio together / alone per repeat (median, min-max, n) and each mode over plain. Every
mode's tokens must equal plain decoding's (greedy): checked, and reported.

    python benches/draft_batch_bench.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --out bench-results/draft_batch_bench.json

Smoke run (SmolLM2 drafting for itself): --model smollm2-135m --draft smollm2-135m --batch-sizes 2 \\
    --max-tokens 8 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import specrs
from specrs import SamplingParams, _specrs, bench

MODES = ("plain", "alone", "together")


def run_batch(engine: specrs.Engine, prompts: list[dict], mode: str, spec: dict, max_tokens: int) -> dict:
    """The prompts through a fresh scheduler in `mode`: wall time, tokens and counts."""
    config, proposer = engine._speculation(False if mode == "plain" else spec, None)
    scheduler = _specrs.Scheduler(engine._inner, max_num_seqs=len(prompts), draft_budget="off",
                                  cost_curve_s=[1.0] * 32, draft_chains_together=mode == "together")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens: list[list[int]] = [[] for _ in prompts]
    accepted = drafted = 0
    start = time.perf_counter()
    for request_id, prompt in enumerate(prompts):
        scheduler.add(request_id, prompt["token_ids"], params, config, proposer)
    while scheduler.has_unfinished:
        outputs, _ = scheduler.step()
        for output in outputs:
            if output["error"] is not None:
                raise RuntimeError(f"request {output['request_id']} failed: {output['error']}")
            tokens[output["request_id"]] += output["token_ids"]
            if output["finished"] is not None:
                accepted += output["finished"]["metrics"]["num_accepted_tokens"]
                drafted += output["finished"]["metrics"]["num_draft_tokens"]
    wall_s = time.perf_counter() - start
    totals = scheduler.totals()
    num_tokens = sum(len(t) for t in tokens)
    return {
        "wall_s": wall_s,
        "num_tokens": num_tokens,
        "tokens_per_s": num_tokens / wall_s,
        "num_steps": totals["num_steps"],
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "num_chains_drafted_together": totals["num_chains_drafted_together"],
        "num_shared_draft_forwards": totals["num_shared_draft_forwards"],
        "tokens": tokens,
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def describe(s: dict) -> str:
    return f"{s['median']:.2f}x (min {s['min']:.2f}, max {s['max']:.2f}, n={s['n']})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="target: a known model's name or a path")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft: a known model's name or a path")
    parser.add_argument("--prompts", default=os.path.join(os.path.dirname(__file__), "code_workload.jsonl"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    engine = specrs.Engine(args.model)
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k,
            "adaptive_draft_length": False}
    prompts = bench.load_prompts(args.prompts, num_per_category=1)
    if len(prompts) < max(args.batch_sizes):
        raise SystemExit(f"{args.prompts} has {len(prompts)} categories; --batch-sizes asks for {max(args.batch_sizes)}")
    prompts = bench.tokenize_prompts(engine, prompts, args.max_tokens, chat=True)
    run_batch(engine, prompts[:1], "together", spec, 4)  # loads the draft, warms both models

    results = []
    for batch_size in args.batch_sizes:
        batch = prompts[:batch_size]
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            order = MODES[repeat % len(MODES):] + MODES[:repeat % len(MODES)]
            for mode in order:
                runs[mode].append(run_batch(engine, batch, mode, spec, args.max_tokens))
        plain_tokens = runs["plain"][0]["tokens"]
        identical = all(r["tokens"] == plain_tokens for mode_runs in runs.values() for r in mode_runs)
        ratio = lambda a, b: spread([x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[a], runs[b])])
        entry = {
            "batch_size": batch_size,
            "identical_to_plain": identical,
            "together_over_alone": ratio("together", "alone"),
            "together_over_plain": ratio("together", "plain"),
            "alone_over_plain": ratio("alone", "plain"),
            "modes": {mode: [{k: v for k, v in r.items() if k != "tokens"} for r in mode_runs]
                      for mode, mode_runs in runs.items()},
        }
        results.append(entry)
        last = {mode: entry["modes"][mode][-1] for mode in MODES}
        print(f"B={batch_size}: together/alone {describe(entry['together_over_alone'])}; "
              f"together/plain {describe(entry['together_over_plain'])}; "
              f"alone/plain {describe(entry['alone_over_plain'])}; identical to plain: {identical}")
        for mode in MODES:
            r = last[mode]
            acceptance = r["num_accepted_tokens"] / r["num_draft_tokens"] if r["num_draft_tokens"] else 0.0
            print(f"    {mode:9s} {r['tokens_per_s']:7.1f} tok/s  {r['num_steps']:4d} steps  "
                  f"acceptance {acceptance:.2f}  chains together {r['num_chains_drafted_together']:4d} "
                  f"in {r['num_shared_draft_forwards']:4d} draft forwards")

    report = {
        "bench": "draft_batch_bench",
        "model": args.model,
        "draft": args.draft,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "k": args.k,
        "repeats": args.repeats,
        "machine": bench.machine_info(),
        "results": results,
    }
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
