"""Heads bench (issue 21): the EAGLE-3 and MLP-speculator heads specrs trains, against plain
decoding, ngram and suffix decoding, and llama-cpp-python's plain decoding, on the same prompts,
in one process, interleaved per prompt.

Workload (benches/spec_bench.py's selection, `select_prompts` with `--mt-bench group`):
- the first 10 prompts (first turn) of mt_bench (the first 10 MT-bench prompts in file order),
  summarization, rag, qa, translation and math_reasoning: 6 categories, 60 prompts.
- per model: SmolLM2-135M-Instruct ("smollm2-135m", its chat template) and Gemma 3 270M
  ("gemma3-270m", a base model without a chat template: the prompt as plain text). A model whose
  GGUF has no chat template gets plain text; prompts are cut by characters of the user text to
  fit 2048 - max_tokens tokens (specrs.bench.truncate_content).
- temperatures 0 (greedy) and 0.7 (seeded, `--seed`, the same seed for every request), 128 new
  tokens, stop at EOS.

Configurations (specrs, one Engine per model and temperature):
- baseline (no speculation);
- eagle3 k=4 with a fixed draft length (every draft verified whole, vLLM's behaviour), and eagle3
  k=4 with specrs' default adaptive draft length;
- mlp_speculator k=3, fixed (its heads draft 3 tokens);
- ngram k=4 (prompt_lookup_min 2, max 4) and suffix k=4, fixed, beside them;
- or `--configs JSON`, a list in their place (e.g. "auto" with a head's "draft_method"; the
  per-drafter counts of "auto" are printed and written under "drafters").
Without "model" the engine fills in the head specrs ships for the loaded model (specrs.heads);
where none ships the configuration is skipped with a note, so the script also runs before heads
ship. `--head MODEL:METHOD=DIR` (or `--eagle3 DIR` / `--mlp DIR` for the first of `--models`)
runs a head directory instead, e.g. one `specrs train-head` just wrote; a head given that way
that does not load is an error, not a skip.
- llama-cpp-python (when importable): plain decoding of the same prompt token ids with the same
  thread count, at the same temperature as the row it sits beside (greedy: temp 0, top_k 1; 0.7:
  temp 0.7, top_k/top_p/min_p off as in specrs' defaults, seeded per request). Plain decoding
  speed hardly depends on the temperature, but sampling does cost a little in both engines, so
  each temperature compares like with like.

A fresh Engine per temperature: suffix decoding caches every response engine-wide, and the
sampled run must not draft from the greedy run's answers to the same prompts.

Figures (specrs.bench.summarize; ratios of sums over the prompts of a category, or of all):
- mean acceptance length 1 + accepted / drafts, and per-position acceptance (drafts whose i-th
  token was accepted / drafts, vLLM's definition);
- decode tokens/s (n - 1) / (last token time - first token time), TTFT excluded; speedup over
  specrs' own baseline on the same prompts; ratio to llama.cpp's plain decode tokens/s.
Goals (issue 21), evaluated for SmolLM2, greedy, eagle3 k=4 (the fixed-length row is the issue's
setting; the adaptive row is evaluated beside it): mean acceptance length >= 2.5 overall, speedup
>= 1.5x its own baseline overall, and >= 1.3x llama.cpp's plain decode tokens/s.

    python benches/heads_bench.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --out bench-results/heads_bench.json

Smoke run (seconds; no llama.cpp):

    python benches/heads_bench.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --models smollm2-135m --num-per-category 1 --limit 2 --max-tokens 16 --no-llama \\
        --out /tmp/heads_bench_smoke.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

import specrs
from specrs import bench
from specrs.errors import ConfigError
from specrs.heads import HEAD_METHODS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spec_bench  # benches/ is no package: its sibling comes from sys.path

LLAMA_LABEL = "llama.cpp plain"

# The issue's goals, for SmolLM2 greedy eagle3 k=4.
GOAL_MODEL = "smollm2-135m"
GOAL_MEAN_ACCEPTANCE_LENGTH = 2.5
GOAL_SPEEDUP = 1.5
GOAL_VS_LLAMA = 1.3


def model_configs() -> list[dict]:
    """The speculative configurations of every model, heads without "model" (see above)."""
    return [
        {"method": "eagle3", "num_speculative_tokens": 4, "adaptive_draft_length": False},
        {"method": "eagle3", "num_speculative_tokens": 4},  # specrs' default adaptive draft length
        {"method": "mlp_speculator", "num_speculative_tokens": 3, "adaptive_draft_length": False},
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
         "adaptive_draft_length": False},
        {"method": "suffix", "num_speculative_tokens": 4, "adaptive_draft_length": False},
    ]


def parse_heads(args: argparse.Namespace, models: list[str]) -> dict[tuple[str, str], str]:
    """{(model, method): head dir} from --head MODEL:METHOD=DIR, --eagle3 DIR and --mlp DIR."""
    heads = {}
    for text in args.head:
        target, _, path = text.partition("=")
        model, _, method = target.rpartition(":")
        if not model or method not in HEAD_METHODS or not path:
            raise SystemExit(f"--head {text!r}: expected MODEL:METHOD=DIR with METHOD one of {', '.join(HEAD_METHODS)}")
        heads[(model, method)] = path
    for method, path in (("eagle3", args.eagle3), ("mlp_speculator", args.mlp)):
        if path:
            heads.setdefault((models[0], method), path)
    unknown = sorted({model for model, _ in heads} - set(models))
    if unknown:
        raise SystemExit(f"--head names models not in --models: {', '.join(unknown)}")
    return heads


def runnable_configs(engine: specrs.Engine, model: str, heads: dict,
                     configs: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """(configs to run, skipped [{config, reason}]) for `model`. `Engine.prepare` loads each head
    now, so a missing or broken one is found before any time is spent, and the head's load time
    stays out of the first measured request."""
    runnable, skipped = [], []
    for config in configs if configs is not None else model_configs():
        if config["method"] in HEAD_METHODS and (model, config["method"]) in heads:
            config = {**config, "model": heads[(model, config["method"])]}
        try:
            engine.prepare(config)
        except ConfigError as e:
            if config["method"] not in HEAD_METHODS or "model" in config:
                raise  # ngram/suffix, or a head the user named: a real error
            # No shipped head for this model (or a wheel from before heads shipped).
            skipped.append({"config": bench.config_label(config), "reason": str(e)})
            continue
        runnable.append(config)
    return runnable, skipped


def uses_chat(engine: specrs.Engine) -> bool:
    """Whether the model has a chat template (Gemma 3 270M, a base model, has none)."""
    try:
        engine.prompt_token_ids([{"role": "user", "content": "hi"}])
    except ConfigError:
        return False
    return True


def count_evals(llm) -> list[int]:
    """Sizes of the Llama's eval calls since the list was last cleared. Llama.generate calls
    self.eval once per forward (the prefill, then one per token); an instance attribute shadowing
    the method counts them, as spec_bench does. Called once per Llama."""
    eval_sizes: list[int] = []
    original_eval = llm.eval

    def counted_eval(tokens):
        eval_sizes.append(len(tokens))
        return original_eval(tokens)

    llm.eval = counted_eval
    return eval_sizes


def llama_plain_runner(llm, eval_sizes: list[int], eos_ids: set[int], temperature: float, seed: int) -> bench.Runner:
    """llama-cpp-python's plain decoding at `temperature`, as a bench runner (`eval_sizes` from
    count_evals(llm)).

    spec_bench.llama_runners also builds its prompt lookup runners, on a second Llama with
    logits_all=True: n_ctx x vocab float32 scores, 2 GiB for Gemma 3's 262144-token vocabulary,
    and greedy only. This is its plain runner with a temperature; the metrics are spec_bench's.
    """
    if temperature == 0:
        sampling = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}
    else:
        # top_k 0, top_p 1 and min_p 0 switch those filters off in both engines (specrs' defaults).
        sampling = {"temp": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}

    def run(prompt: dict, max_tokens: int):
        llm.set_seed(seed)  # the same seed for every request, as specrs' SamplingParams(seed=...)
        # reset() empties the cache; otherwise generate() reuses the previous run's prompt prefix.
        llm.reset()
        eval_sizes.clear()
        token_ids, times = [], []
        start = time.perf_counter()
        generator = llm.generate(prompt["token_ids"], repeat_penalty=1.0, reset=True, **sampling)
        for token in generator:
            times.append(time.perf_counter())
            token_ids.append(token)
            if token in eos_ids or len(token_ids) >= max_tokens:
                break
        generator.close()
        finish_reason = "stop" if token_ids and token_ids[-1] in eos_ids else "length"
        yielded_per_eval = [1] * len(eval_sizes)  # plain decoding: one token per forward
        metrics = spec_bench.llama_metrics(prompt, None, token_ids, times, start, eval_sizes, yielded_per_eval)
        return metrics, token_ids, finish_reason

    return bench.Runner(LLAMA_LABEL, "llama.cpp", run, is_baseline=True)


def compact(agg: dict, llama: dict | None) -> dict:
    """The figures the issue asks for, from one bench.aggregate (with its speedup). llama.cpp's own
    row gets no speedup and no output match: both would compare it with itself."""
    speculative = agg["num_speculative_tokens"] > 0
    own = agg["engine"] == "specrs"
    return {
        "num_requests": agg["num_requests"],
        "num_generated_tokens": agg["num_generated_tokens"],
        "mean_acceptance_length": agg["mean_acceptance_length"] if speculative else None,
        "acceptance_rate": agg["acceptance_rate"] if speculative else None,
        "acceptance_rate_per_pos": agg["acceptance_rate_per_pos"],
        "tokens_per_forward": agg["tokens_per_forward"],
        "decode_tokens_per_s": agg["decode_tokens_per_s"],
        "speedup": agg["speedup"] if own else None,
        "vs_llama_cpp": (agg["decode_tokens_per_s"] / llama["decode_tokens_per_s"]
                         if llama and llama["decode_tokens_per_s"] else None),
        "num_matching_baseline": agg["num_matching_baseline"] if own else None,
    }


def results_by_config(summary: dict) -> dict:
    """{label: {"overall": compact, "categories": {category: compact}}}; vs_llama_cpp compares
    with llama.cpp's plain decoding on the same prompts (the category's, or all)."""
    out = {}
    for label, agg in summary["overall"].items():
        out[label] = {
            "overall": compact(agg, summary["overall"].get(LLAMA_LABEL)),
            "categories": {category: compact(rows[label], rows.get(LLAMA_LABEL))
                           for category, rows in summary["categories"].items() if label in rows},
        }
    return out


def evaluate_goals(results: dict, configs_by_label: dict) -> dict:
    """The issue's goals for every eagle3 k=4 row of one run (SmolLM2 greedy)."""
    goals = {}
    for label, config_entry in configs_by_label.items():
        config = config_entry["requested"] if config_entry else {}
        if config.get("method") != "eagle3" or config.get("num_speculative_tokens") != 4:
            continue
        overall = results[label]["overall"]
        checks = {
            "mean_acceptance_length": (overall["mean_acceptance_length"], GOAL_MEAN_ACCEPTANCE_LENGTH),
            "speedup": (overall["speedup"], GOAL_SPEEDUP),
            "vs_llama_cpp": (overall["vs_llama_cpp"], GOAL_VS_LLAMA),
        }
        entry = {name: {"value": value, "goal": goal, "met": None if value is None else value >= goal}
                 for name, (value, goal) in checks.items()}
        entry["all_met"] = all(e["met"] for e in entry.values())
        goals[label] = entry
    return goals


def format_table(results: dict, greedy: bool) -> str:
    """Overall figures per configuration."""
    lines = ["| config | mean acc. len | acceptance per position | tokens per forward | decode tok/s | speedup | "
             "vs llama.cpp |" + (" same output as baseline |" if greedy else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if greedy else "")]
    for label, entry in results.items():
        r = entry["overall"]
        per_pos = " ".join(f"{rate:.2f}" for rate in r["acceptance_rate_per_pos"]) or "-"
        line = (f"| {label} | {bench.fmt(r['mean_acceptance_length'], '.2f')} | {per_pos} | "
                f"{r['tokens_per_forward']:.2f} | {r['decode_tokens_per_s']:.1f} | {bench.fmt(r['speedup'], '.2f', 'x')} | "
                f"{bench.fmt(r['vs_llama_cpp'], '.2f', 'x')} |")
        if greedy:
            matching = r["num_matching_baseline"]
            line += f" {'-' if matching is None else str(matching) + '/' + str(r['num_requests'])} |"
        lines.append(line)
    return "\n".join(lines)


def format_category_table(results: dict, categories: list[str]) -> str:
    """Mean acceptance length / speedup per category, speculative configurations only."""
    lines = ["| config | " + " | ".join(categories) + " | overall |", "|---" * (len(categories) + 2) + "|"]
    for label, entry in results.items():
        if entry["overall"]["mean_acceptance_length"] is None:
            continue  # baseline, llama.cpp: no acceptance

        def cell(r):
            return f"{r['mean_acceptance_length']:.2f} / {bench.fmt(r['speedup'], '.2f', 'x')}"

        cells = [cell(entry["categories"][c]) if c in entry["categories"] else "-" for c in categories]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {cell(entry['overall'])} |")
    return "\n".join(lines)


def drafter_totals(records: list[dict]) -> dict:
    """{config: {drafter: {num_drafts, num_draft_tokens, num_accepted_tokens}}} summed over the
    requests of every configuration that reports its drafters ("auto")."""
    totals: dict = {}
    for record in records:
        for name, counts in (record["metrics"].get("drafters") or {}).items():
            entry = totals.setdefault(record["config"], {}).setdefault(name, dict.fromkeys(counts, 0))
            for key, value in counts.items():
                entry[key] += value
    return totals


def format_goals(goals: dict) -> str:
    lines = []
    for label, entry in goals.items():
        verdict = {True: "met", False: "NOT met", None: "not measured"}
        parts = [f"{name} {bench.fmt(e['value'], '.2f')} (>= {e['goal']}: {verdict[e['met']]})"
                 for name, e in entry.items() if name != "all_met"]
        lines.append(f"- {label}: " + ", ".join(parts))
    return "\n".join(lines)


def run_model(model: str, prompts: list[dict], args: argparse.Namespace, temperatures: list[float],
              heads: dict) -> dict:
    """Every configuration of `model` at every temperature; the model's part of the report."""
    engine = specrs.Engine(model)
    chat = uses_chat(engine)
    if not chat:
        print(f"{model}: no chat template, prompts sent as plain text", file=sys.stderr)
    prompts = bench.tokenize_prompts(engine, [dict(p) for p in prompts], args.max_tokens, chat=chat)
    configs, skipped = runnable_configs(engine, model, heads, args.configs)
    for s in skipped:
        print(f"{model}: skipping {s['config']}: {s['reason']}", file=sys.stderr)
    configs_by_label = {bench.BASELINE_LABEL: None}
    for config in configs:
        # The shipped head's path, as the engine fills it in (older wheels have no config_json).
        resolved = json.loads(engine.config_json(config)) if hasattr(engine, "config_json") else config
        configs_by_label[bench.config_label(config)] = {"requested": config, "resolved": resolved}
    max_k = max((entry["resolved"]["num_speculative_tokens"] for entry in configs_by_label.values() if entry),
                default=0)
    verify_cost = engine.verify_cost_ratios(max_k + 1) if max_k else None

    llm, eval_sizes = None, []
    if not args.no_llama:
        try:
            from llama_cpp import Llama
        except ImportError:
            print("llama_cpp is not importable: running specrs only", file=sys.stderr)
        else:
            llm = Llama(model_path=engine.model_path, n_ctx=bench.DEFAULT_MAX_CONTEXT, n_threads=args.threads,
                        n_threads_batch=args.threads, seed=args.seed, logits_all=False, verbose=False)
            eval_sizes = count_evals(llm)
    eos_ids = set(engine.tokenizer.eos_token_ids)

    report = {
        "model_path": engine.model_path,
        "model_info": engine.info(),
        "chat_template": chat,
        "configs": configs_by_label,
        "skipped": skipped,
        "verify_cost_ratios": verify_cost,
        "prompts": [{key: p[key] for key in ("question_id", "category", "orig_category", "prompt_tokens", "truncated")}
                    for p in prompts],
        "temperatures": {},
    }
    for temperature in temperatures:
        if engine is None:
            # A fresh engine: the suffix cache of the previous temperature's run goes with the old one.
            engine = specrs.Engine(model)
            for config in configs:
                engine.prepare(config)
        params = specrs.SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                       seed=args.seed if temperature > 0 else None)
        runners = [bench.specrs_runner(engine, c, params) for c in [None] + configs]
        if llm is not None:
            runners.append(llama_plain_runner(llm, eval_sizes, eos_ids, temperature, args.seed))
        bench.check_unique_labels(runners)
        print(f"{model} T={temperature:g}: {len(prompts)} prompts ({sum(p['truncated'] for p in prompts)} cut to fit), "
              f"{len(runners)} configurations, {args.max_tokens} tokens", file=sys.stderr)
        records = bench.run_benchmark(prompts, runners, args.max_tokens, greedy=temperature == 0,
                                      progress=not args.no_progress)
        summary = bench.summarize(records, runners, {"specrs": verify_cost} if verify_cost else None)
        results = results_by_config(summary)
        run = {
            "temperature": temperature,
            "seed": args.seed if temperature > 0 else None,
            "llama_cpp": None if llm is None else {
                "sampling": "greedy" if temperature == 0 else f"temp {temperature:g}, seed {args.seed}",
                "threads": args.threads, "n_ctx": bench.DEFAULT_MAX_CONTEXT},
            "results": results,
            "drafters": drafter_totals(records),
            "aggregates": {"overall": summary["overall"], "categories": summary["categories"]},
            "records": records,
        }
        if model == GOAL_MODEL and temperature == 0:
            run["goals"] = evaluate_goals(results, configs_by_label)
        report["temperatures"][f"{temperature:g}"] = run

        mode = "greedy" if temperature == 0 else f"T={temperature:g}, seed {args.seed}"
        print(f"\n### {model}, {mode}, {len(prompts)} prompts\n")
        print(format_table(results, greedy=temperature == 0))
        print("\nMean acceptance length / speedup per category:\n")
        print(format_category_table(results, list(summary["categories"])))
        for label, drafters in run["drafters"].items():
            print(f"\n{label}: " + "; ".join(f"{name} {c['num_drafts']} drafts, {c['num_draft_tokens']} tokens, "
                                            f"{c['num_accepted_tokens']} accepted" for name, c in drafters.items()))
        if "goals" in run:
            print("\nIssue 21 goals (overall):\n")
            print(format_goals(run["goals"]) or "- no eagle3 k=4 row ran (no head): goals not evaluated")
        sys.stdout.flush()
        engine = runners = None  # the runners hold the engine too
        gc.collect()  # free the engine (weights, KV cache) before the next one loads
    if llm is not None and hasattr(llm, "close"):
        llm.close()
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="Spec-Bench question.jsonl")
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m",
                    help="comma list of specrs model names or GGUF paths")
    ap.add_argument("--temperatures", default="0,0.7", help="comma list; 0 = greedy")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of every request when temperature > 0")
    ap.add_argument("--num-per-category", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="only the first N selected prompts (smoke runs)")
    ap.add_argument("--head", action="append", default=[], metavar="MODEL:METHOD=DIR",
                    help="run this head directory for MODEL (as in --models) and METHOD (eagle3 or mlp_speculator) "
                         "instead of the shipped one; repeatable")
    ap.add_argument("--eagle3", default=None, metavar="DIR", help="--head FIRST_MODEL:eagle3=DIR")
    ap.add_argument("--mlp", default=None, metavar="DIR", help="--head FIRST_MODEL:mlp_speculator=DIR")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (default: all CPUs)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-cpp-python even when importable")
    ap.add_argument("--configs", type=json.loads, default=None, metavar="JSON",
                    help="a JSON list of speculative configs in place of the default ones (heads without "
                         "\"model\", and \"auto\" with a head's \"draft_method\", get the shipped head)")
    ap.add_argument("--out", default="bench-results/heads_bench.json", help="JSON output path")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    if not models or not temperatures:
        raise SystemExit("--models and --temperatures need at least one entry each")
    heads = parse_heads(args, models)
    prompts = spec_bench.select_prompts(args.prompts, args.num_per_category, "group")
    if args.limit:
        prompts = prompts[: args.limit]

    llama_version = None
    if not args.no_llama:
        try:
            import llama_cpp
            llama_version = llama_cpp.__version__
        except ImportError:
            pass
    report = {
        "args": vars(args),
        "machine": bench.machine_info(),
        "versions": {"specrs": specrs.__version__, "python": platform.python_version(),
                     "llama_cpp_python": llama_version},
        "models": {},
    }
    for model in models:
        report["models"][model] = run_model(model, prompts, args, temperatures, heads)
        gc.collect()
    # The goals at the top too ({} when no eagle3 k=4 row ran; None when SmolLM2 greedy did not run).
    report["goals"] = report["models"].get(GOAL_MODEL, {}).get("temperatures", {}).get("0", {}).get("goals")
    bench.write_json(args.out, report)
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
