"""Tree bench (issue 22): chains against token trees at equal verify budgets, and the automatic
chooser, for suffix decoding, n-gram and the shipped EAGLE-3 head, on SmolLM2-135M-Instruct and
Gemma 3 270M, greedy and at temperature 0.7, in one process, interleaved per prompt.

Workload: benches/spec_bench.py's selection (`select_prompts`, mt_bench as one group): the first
`--num-per-category` first-turn prompts of mt_bench, summarization, rag, qa, translation and
math_reasoning, `--max-tokens` new tokens; SmolLM2 with its chat template, Gemma 3 270M (a base
model) with plain text. One Engine per model and temperature (suffix decoding caches responses
engine-wide; the sampled run must not draft from the greedy run's answers).

Configurations per method, at verify budgets of B rows (the newest token plus B - 1 draft tokens):
- chain: num_speculative_tokens = B - 1, every draft verified whole (adaptive length off);
- tree: a tree of at most B - 1 nodes, verified whole ("tree": true, top_k 4 children per node;
  EAGLE-3's tree 4 levels deep, as trained);
- auto: "tree": "auto" with the largest budget `--auto-budget`: per step the chooser picks chain,
  tree or nothing, and the size, from the measured cost curve and the request's acceptance per
  depth and rank.
EAGLE-3 chains stop at 8 rows: its head drafts one token per head step, and positions past its
trained 4 accept almost nothing (issue 21), so a 15- or 31-token chain only measures drafting cost.

Figures (specrs.bench.summarize): mean accepted tokens per step (1 + accepted / drafts), tokens
per forward, decode tokens/s, speedup over the baseline on the same prompts; per category. The
chooser's goal: never slower than the best fixed configuration of its method by more than noise,
on any category. "gpu_projection": the speedup each configuration would get where verifying B
rows costs what one row does (a flat cost curve: a GPU below its compute bound) and drafting is
free: its measured tokens per forward (a lower bound on what a tree adds there: no chooser would
then cut a tree for cost).

    python benches/tree_bench.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --out bench-results/tree_bench.json

Smoke run: --models smollm2-135m --num-per-category 1 --limit 2 --max-tokens 16 --budgets 4
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys

import specrs
from specrs import bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import heads_bench  # noqa: E402  (benches/ is no package: siblings come from sys.path)
import spec_bench  # noqa: E402

METHODS = {
    "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix"},
    "eagle3": {"method": "eagle3"},
}
EAGLE3_MAX_CHAIN_ROWS = 8
EAGLE3_TREE_DEPTH = 4
TOP_K = 4


def configs_for(method: str, budgets: list[int], auto_budget: int) -> list[dict]:
    base = METHODS[method]
    configs = []
    for rows in budgets:
        if method != "eagle3" or rows <= EAGLE3_MAX_CHAIN_ROWS:
            configs.append({**base, "num_speculative_tokens": rows - 1, "adaptive_draft_length": False})
        tree = {**base, "num_speculative_tokens": rows - 1, "tree": True, "tree_top_k": TOP_K}
        if method == "eagle3":
            tree["tree_depth"] = min(EAGLE3_TREE_DEPTH, rows - 1)
        configs.append(tree)
    auto = {**base, "num_speculative_tokens": auto_budget - 1, "tree": "auto", "tree_top_k": TOP_K}
    if method == "eagle3":
        auto["tree_depth"] = EAGLE3_TREE_DEPTH
    configs.append(auto)
    return configs


def shape(config: dict) -> str:
    return {None: "chain", True: "tree", "auto": "auto"}[config.get("tree")]


def chooser_verdicts(results: dict, configs_by_label: dict, categories: list[str], noise: float) -> dict:
    """Per method and category: the auto row's tokens/s against the best fixed row of its method;
    `within_noise` when it is at least (1 - noise) of it."""
    verdicts = {}
    for method in METHODS:
        labels = [label for label, c in configs_by_label.items() if c and c["method"] == method]
        auto = [label for label in labels if shape(configs_by_label[label]) == "auto"]
        fixed = [label for label in labels if shape(configs_by_label[label]) != "auto"]
        if not auto or not fixed:
            continue
        entry = {}
        for category in categories + ["overall"]:
            def tps(label):
                r = results[label]["overall"] if category == "overall" else results[label]["categories"].get(category)
                return r["decode_tokens_per_s"] if r else None

            best = max(fixed, key=lambda label: tps(label) or 0.0)
            ratio = tps(auto[0]) / tps(best) if tps(best) else None
            entry[category] = {"auto": tps(auto[0]), "best_fixed": best, "best_fixed_tokens_per_s": tps(best),
                               "ratio": ratio, "within_noise": ratio is not None and ratio >= 1 - noise}
        verdicts[method] = entry
    return verdicts


def format_table(results: dict, configs_by_label: dict) -> str:
    lines = ["| method | shape | rows | mean acc. len | tok/forward | decode tok/s | speedup | GPU projection | same output |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, entry in results.items():
        config = configs_by_label.get(label)
        r = entry["overall"]
        rows = config["num_speculative_tokens"] + 1 if config else 1
        lines.append(
            f"| {config['method'] if config else 'baseline'} | {shape(config) if config else '-'} | {rows} | "
            f"{bench.fmt(r['mean_acceptance_length'], '.2f')} | {r['tokens_per_forward']:.2f} | "
            f"{r['decode_tokens_per_s']:.1f} | {bench.fmt(r['speedup'], '.2f', 'x')} | "
            f"{r['tokens_per_forward']:.2f}x | "
            f"{'-' if r['num_matching_baseline'] is None else str(r['num_matching_baseline']) + '/' + str(r['num_requests'])} |")
    return "\n".join(lines)


def format_verdicts(verdicts: dict) -> str:
    lines = []
    for method, entry in verdicts.items():
        worst = min((e for c, e in entry.items() if e["ratio"] is not None), key=lambda e: e["ratio"])
        misses = [c for c, e in entry.items() if not e["within_noise"]]
        lines.append(f"- {method}: auto / best fixed overall {bench.fmt(entry['overall']['ratio'], '.2f')} "
                     f"(best fixed {entry['overall']['best_fixed']}); worst category {worst['ratio']:.2f}; "
                     f"outside noise in: {', '.join(misses) or 'none'}")
    return "\n".join(lines)


def run_model(model: str, prompts: list[dict], args: argparse.Namespace) -> dict:
    engine = specrs.Engine(model)
    chat = heads_bench.uses_chat(engine)
    prompts = bench.tokenize_prompts(engine, [dict(p) for p in prompts], args.max_tokens, chat=chat)
    configs = [c for m in args.methods for c in configs_for(m, args.budgets, args.auto_budget)]
    verify_cost = engine.verify_cost_ratios(max(args.budgets + [args.auto_budget]))
    report = {"model_path": engine.model_path, "model_info": engine.info(), "chat_template": chat,
              "verify_cost_ratios": verify_cost, "temperatures": {},
              "prompts": [{k: p[k] for k in ("question_id", "category", "prompt_tokens", "truncated")} for p in prompts]}
    for temperature in args.temperatures:
        if engine is None:
            engine = specrs.Engine(model)
        for config in configs:
            engine.prepare(config)  # loads the head and measures the cost curve before timing
        params = specrs.SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                       seed=args.seed if temperature > 0 else None)
        runners = [bench.specrs_runner(engine, c, params) for c in [None] + configs]
        configs_by_label = {r.label: c for r, c in zip(runners, [None] + configs)}
        print(f"{model} T={temperature:g}: {len(prompts)} prompts, {len(runners)} configurations", file=sys.stderr)
        records = bench.run_benchmark(prompts, runners, args.max_tokens, greedy=temperature == 0,
                                      progress=not args.no_progress)
        summary = bench.summarize(records, runners, {"specrs": verify_cost})
        results = heads_bench.results_by_config(summary)
        verdicts = chooser_verdicts(results, configs_by_label, list(summary["categories"]), args.noise)
        report["temperatures"][f"{temperature:g}"] = {
            "temperature": temperature, "seed": args.seed if temperature > 0 else None,
            "configs": configs_by_label, "results": results, "chooser": verdicts,
            "aggregates": {"overall": summary["overall"], "categories": summary["categories"]},
            "records": records,
        }
        mode = "greedy" if temperature == 0 else f"T={temperature:g}, seed {args.seed}"
        print(f"\n### {model}, {mode}, {len(prompts)} prompts\n")
        print(format_table(results, configs_by_label))
        print("\nMean acceptance length / speedup per category:\n")
        print(heads_bench.format_category_table(results, list(summary["categories"])))
        print("\nChooser against the best fixed configuration of its method (decode tokens/s):\n")
        print(format_verdicts(verdicts))
        sys.stdout.flush()
        engine = runners = None
        gc.collect()
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="Spec-Bench question.jsonl")
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--methods", default="ngram,suffix,eagle3")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--budgets", default="4,8,16,32", help="verify rows per step (newest token + drafts)")
    ap.add_argument("--auto-budget", type=int, default=16, help="the chooser's largest budget, in rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-per-category", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.05, help="relative tokens/s difference taken as noise")
    ap.add_argument("--out", default="bench-results/tree_bench.json")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    args.temperatures = [float(t) for t in args.temperatures.split(",") if t]
    args.budgets = [int(b) for b in args.budgets.split(",") if b]
    if unknown := set(args.methods) - set(METHODS):
        raise SystemExit(f"--methods: unknown {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
    if min(args.budgets + [args.auto_budget]) < 2:
        raise SystemExit("budgets count rows including the newest token: at least 2")
    prompts = spec_bench.select_prompts(args.prompts, args.num_per_category, "group")
    if args.limit:
        prompts = prompts[: args.limit]
    report = {"args": vars(args), "machine": bench.machine_info(),
              "versions": {"specrs": specrs.__version__, "python": platform.python_version()}, "models": {}}
    for model in [m for m in args.models.split(",") if m]:
        report["models"][model] = run_model(model, prompts, args)
        gc.collect()
    bench.write_json(args.out, report)
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
