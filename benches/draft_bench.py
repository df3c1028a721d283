"""Draft-model family on Spec-Bench: draft_model, layer_skip, quantized_self and PARD, beside no
speculation and the best model-free method (ngram k=4, adaptive), in one process, interleaved per
prompt (the workload of benches/spec_bench.py: chat template, greedy, 128 tokens).

Per method and k (fixed draft length, so every draft is verified whole): acceptance rate, mean
acceptance length, draft cost c (proposer seconds per draft over the baseline's seconds per token,
and per draft token), measured speedup and the expected-speedup prediction (textbook and refined
with the measured verify cost v(k+1)). Each method also runs once with specrs' default adaptive
draft length, which stops drafting when drafts do not pay.

Dynamic speculation length at low acceptance (layer_skip, exit layer 12): fixed k in {1, 2, 4, 8},
transformers' heuristic schedule from k=8, a confidence threshold of 0.4 at k=8, and the adaptive
policy at k=8 -- does shrinking k help more than growing it?

The draft_model and pard drafts are SmolLM2 requantized to Q8_0, written to a GGUF file and
loaded as a separate model (no smaller model with SmolLM2's tokenizer ships on PyPI).

    python benches/draft_bench.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --num-per-category 5 --out bench-results/draft_bench.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import specrs
from specrs import bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_bench import select_prompts  # noqa: E402

LOW_ACCEPTANCE_EXIT = 12
PARD_MASK_TOKEN_ID = 0  # any id: the draft is not PARD-trained, see the docs


def draft_configs(draft_path: str) -> list[dict]:
    fixed = {"adaptive_draft_length": False}
    configs = [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}]
    for k in (2, 4):
        configs.append({"method": "draft_model", "model": draft_path, "num_speculative_tokens": k, **fixed})
    configs.append({"method": "draft_model", "model": draft_path, "num_speculative_tokens": 4})
    for k in (2, 4):
        configs.append({"method": "quantized_self", "quantization": "q4_0", "num_speculative_tokens": k, **fixed})
    configs.append({"method": "quantized_self", "quantization": "q4_0", "num_speculative_tokens": 4})
    for exit_layer in (4, 8, LOW_ACCEPTANCE_EXIT):
        for k in (2, 4):
            configs.append({"method": "layer_skip", "exit_layer": exit_layer, "num_speculative_tokens": k, **fixed})
    for k in (2, 4):
        configs.append({"method": "pard", "model": draft_path, "mask_token_id": PARD_MASK_TOKEN_ID,
                        "num_speculative_tokens": k, **fixed})
    # Dynamic length at low acceptance (k = 2 and 4 fixed are above).
    low = {"method": "layer_skip", "exit_layer": LOW_ACCEPTANCE_EXIT}
    for k in (1, 8):
        configs.append({**low, "num_speculative_tokens": k, **fixed})
    configs.append({**low, "num_speculative_tokens": 8, "num_speculative_tokens_schedule": "heuristic", **fixed})
    configs.append({**low, "num_speculative_tokens": 8, "draft_confidence_threshold": 0.4, **fixed})
    configs.append({**low, "num_speculative_tokens": 8})
    return configs


def per_token_cost_table(summary: dict) -> str:
    lines = ["| config | acc. rate | mean acc. len | c per draft | c per draft token | measured | textbook | refined |",
             "|---|---|---|---|---|---|---|---|"]
    for label, agg in summary["overall"].items():
        expected = agg.get("expected_speedup") or {}
        c, k = expected.get("draft_cost"), expected.get("mean_draft_length")
        per_token = c / k if c is not None and k else None
        lines.append(f"| {label} | {bench.fmt(agg['acceptance_rate'] if agg['num_drafts'] else None, '.2f')} | "
                     f"{agg['mean_acceptance_length']:.2f} | {bench.fmt(c, '.2f')} | {bench.fmt(per_token, '.2f')} | "
                     f"{bench.fmt(agg['speedup'], '.2f', 'x')} | {bench.fmt(expected.get('textbook'), '.2f', 'x')} | "
                     f"{bench.fmt(expected.get('refined'), '.2f', 'x')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="Spec-Bench question.jsonl")
    ap.add_argument("--out", default="bench-results/draft_bench.json")
    ap.add_argument("--num-per-category", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (smoke runs)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()

    model_path = specrs.default_model_path()
    engine = specrs.Engine(model_path)
    workdir = tempfile.mkdtemp(prefix="specrs-draft-bench-")
    draft_path = os.path.join(workdir, "smollm2-q8_0.gguf")
    specrs.requantize(model_path, draft_path, "q8_0")

    prompts = select_prompts(args.prompts, args.num_per_category, "group")
    if args.limit:
        prompts = prompts[: args.limit]
    prompts = bench.tokenize_prompts(engine, prompts, args.max_tokens, chat=True)
    params = specrs.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    configs = draft_configs(draft_path)
    runners = [bench.specrs_runner(engine, None, params)] + [bench.specrs_runner(engine, c, params) for c in configs]
    bench.check_unique_labels(runners)
    print(f"{len(prompts)} prompts, {len(runners)} configurations", file=sys.stderr)

    records = bench.run_benchmark(prompts, runners, args.max_tokens, greedy=True, progress=not args.no_progress)
    max_k = max(r.num_speculative_tokens for r in runners)
    verify_cost = engine.verify_cost_ratios(max_k + 1)
    summary = bench.summarize(records, runners, {"specrs": verify_cost})
    print(bench.format_tables(summary))
    print("\nDraft cost and prediction (overall):\n")
    print(per_token_cost_table(summary))
    print("\nverify cost v(n) = t(n)/t(1): " + " ".join(f"{n}:{v:.2f}" for n, v in enumerate(verify_cost, 1)))
    print(f"memory after the run: {engine.memory()}")

    labels = {r.label: c for r, c in zip(runners, [None] + configs)}
    report = bench.make_report(engine, args, prompts, labels, records, summary, verify_cost)
    report["memory"] = engine.memory()
    bench.write_json(args.out, report)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
