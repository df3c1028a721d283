"""Coupled against rejection verification of sampled model drafts (issue 40 item 1): how often the
target accepts a draft model's (or a head's, or a self-draft's) sampled tokens when they are drawn
with the target's own positional uniforms and accepted iff equal to the target's sample
("verification": "coupled", the default: the output is plain sampling's, token for token), and
when they are drawn from the draft's own stream and verified by rejection sampling with q
("verification": "rejection": exact in distribution, accepts with probability sum min(p, q) per
token, but a seeded request's tokens depend on its draft lengths).

Acceptance counts tokens, not time, so the figures do not depend on the machine's load. Per pair,
temperature and prompt: one seeded request per verification at a fixed k (no adaptive length, so
both verify the same number of draft tokens per step), and a plain sampled run with the same seed
whose tokens the coupled run must equal (checked and reported).

Workload: the first prompt of each of --categories Spec-Bench categories (../shared/data/spec_bench
by default), chat-templated where the model has a template, --max-tokens each.

    python benches/verification_bench.py --out bench-results/verification_bench.json

Smoke run: --pairs smollm2-eagle3 --categories 1 --max-tokens 8 --temperatures 1.0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import specrs
from specrs import SamplingParams, bench

DEFAULT_PROMPTS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "spec_bench", "question.jsonl")

# name -> (target, speculative config without verification; k is --k unless the config caps it)
PAIRS = {
    "qwen-1.5b+0.5b": ("qwen2.5-coder-1.5b", {"method": "draft_model", "model": "qwen2.5-coder-0.5b"}),
    "smollm2-eagle3": ("smollm2-135m", {"method": "eagle3"}),
    "smollm2-mlp_speculator": ("smollm2-135m", {"method": "mlp_speculator", "num_speculative_tokens": 3}),
    "gemma3-eagle3": ("gemma3-270m", {"method": "eagle3"}),
    "smollm2-quantized_self": ("smollm2-135m", {"method": "quantized_self", "quantization": "q4_0"}),
    "smollm2-layer_skip": ("smollm2-135m", {"method": "layer_skip", "exit_layer": 20}),
}
VERIFICATIONS = ("coupled", "rejection")


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "min": min(values),
            "max": max(values), "n": len(values)}


def run_pair(engine: specrs.Engine, spec: dict, prompts: list[dict], temperature: float, k: int,
             max_tokens: int, seed: int) -> dict:
    per_prompt = {v: [] for v in VERIFICATIONS}
    identical = True
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i, ignore_eos=True)
        plain = engine.generate(prompt["token_ids"], params, speculative_config=False).token_ids
        for verification in VERIFICATIONS:
            config = {"num_speculative_tokens": k, **spec, "adaptive_draft_length": False,
                      "verification": verification}
            r = engine.generate(prompt["token_ids"], params, speculative_config=config)
            m = r.metrics
            per_prompt[verification].append({
                "acceptance": m["num_accepted_tokens"] / m["num_draft_tokens"] if m["num_draft_tokens"] else 0.0,
                "accepted_per_draft": m["num_accepted_tokens"] / m["num_drafts"] if m["num_drafts"] else 0.0,
                "num_draft_tokens": m["num_draft_tokens"],
            })
            if verification == "coupled":
                identical &= r.token_ids == plain
    return {
        "acceptance": {v: spread([p["acceptance"] for p in per_prompt[v]]) for v in VERIFICATIONS},
        "accepted_per_draft": {v: spread([p["accepted_per_draft"] for p in per_prompt[v]]) for v in VERIFICATIONS},
        "coupled_over_rejection": spread([c["accepted_per_draft"] / r["accepted_per_draft"]
                                          for c, r in zip(per_prompt["coupled"], per_prompt["rejection"])
                                          if r["accepted_per_draft"] > 0]),
        "coupled_equals_plain_sampling": identical,
    }


def report(args: argparse.Namespace, results: list[dict]) -> dict:
    return {"bench": "verification_bench", "prompts": args.prompts, "categories": args.categories,
            "k": args.k, "max_tokens": args.max_tokens, "seed": args.seed, "results": results,
            "machine": bench.machine_info()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS)
    parser.add_argument("--categories", type=int, default=13, help="first prompt of this many categories")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    all_prompts = bench.load_prompts(args.prompts, num_per_category=1)[: args.categories]
    results = []
    engines: dict[str, specrs.Engine] = {}
    for name in args.pairs:
        target, spec = PAIRS[name]
        engine = engines.setdefault(target, specrs.Engine(target))
        chat = engine.info()["has_chat_template"]  # Gemma 3's GGUF has none: its prompts go as text
        prompts = bench.tokenize_prompts(engine, all_prompts, args.max_tokens, chat=chat)
        for temperature in args.temperatures:
            entry = {"pair": name, "target": target, "spec": spec, "temperature": temperature,
                     **run_pair(engine, spec, prompts, temperature, args.k, args.max_tokens, args.seed)}
            results.append(entry)
            a, d, ratio = entry["acceptance"], entry["accepted_per_draft"], entry["coupled_over_rejection"]
            if args.out:  # after each pair, so an interrupted run keeps what it measured
                bench.write_json(args.out, report(args, results))
            print(f"{name:24s} T={temperature:.1f}: acceptance coupled {a['coupled']['mean']:.3f} "
                  f"vs rejection {a['rejection']['mean']:.3f}; accepted per draft {d['coupled']['mean']:.2f} vs "
                  f"{d['rejection']['mean']:.2f}; coupled/rejection per prompt median "
                  f"{ratio['median']:.2f} (min {ratio['min']:.2f}, max {ratio['max']:.2f}, n={ratio['n']}); "
                  f"coupled = plain sampling: {entry['coupled_equals_plain_sampling']}", flush=True)


if __name__ == "__main__":
    main()
