"""Spec-Bench: specrs speculative decoding against plain decoding, and against llama-cpp-python's
plain and prompt-lookup decoding, on the same prompts, in one process, interleaved per prompt.

Workload (as the anchor harness, shared/anchors/common.py):
- the first 10 prompts (first turn) of summarization, rag, qa, translation, math_reasoning, and 10
  MT-bench prompts reported as "mt_bench" (the file has no "mt_bench" category; its MT-bench
  categories are writing, roleplay, reasoning, math, coding, extraction, stem, humanities).
  `--mt-bench group` (default) takes the first 10 of those in file order, exactly the anchors'
  selection (all "writing"); `spread` takes them round-robin over the 8 categories; `split` reports
  each of the 8 separately with `--num-per-category` prompts each.
- SmolLM2's chat template (the GGUF's own, default system message included; `--no-chat`: the
  user text alone, for a base model without one); prompts cut by characters of the user text to
  fit 2048 - max_tokens tokens (specrs.bench.truncate_content).
- greedy, 128 new tokens, stop at EOS.
- any other prompt file (the code workload, benches/code_workload.jsonl): its own categories,
  `--num-per-category` prompts each (`select_prompts`).

Configurations:
- specrs: baseline; ngram k in {2, 4, 8} for each --ngram-window MIN:MAX (default 2:4, see
  benches/README.md for why); suffix k in {2, 4, 8} with vLLM's suffix defaults.
- llama-cpp-python (when importable): plain decoding, and prompt lookup decoding
  (LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=k), the anchors' setting) for the
  same k. Both engines get the same prompt token ids and the same thread count.

Tokens/s is decode-only for both engines: (n - 1) / (last token time - first token time), from
token arrival times (specrs measures them in Rust; llama.cpp's are taken as its streaming generator
yields). Acceptance for llama.cpp is counted by wrapping Llama.eval, as shared/anchors does.

    python benches/spec_bench.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --out bench-results/spec_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import specrs
from specrs import bench

SPEC_BENCH_CATEGORIES = ["summarization", "rag", "qa", "translation", "math_reasoning"]
MT_BENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
K_VALUES = [2, 4, 8]
# llama-cpp-python's prompt lookup tries n-grams of max_ngram_size down to 1; 2 is the anchors' value.
LLAMA_MAX_NGRAM = 2


def select_prompts(path: str, num_per_category: int, mt_bench: str) -> list[dict]:
    """The workload above: mt_bench first, then the Spec-Bench categories (the anchors' order).
    A file with none of Spec-Bench's or MT-bench's categories (benches/code_workload.jsonl) gives
    the first `num_per_category` prompts of each of its own categories, in file order."""
    own_categories = {p["orig_category"] for p in bench.load_prompts(path)}
    if not own_categories & set(SPEC_BENCH_CATEGORIES + MT_BENCH_CATEGORIES):
        return bench.load_prompts(path, num_per_category=num_per_category)
    if mt_bench == "split":
        mt = bench.load_prompts(path, groups={c: [c] for c in MT_BENCH_CATEGORIES}, num_per_category=num_per_category)
    else:
        mt = bench.load_prompts(path, groups={"mt_bench": MT_BENCH_CATEGORIES})
        if mt_bench == "spread":
            # Round-robin over the 8 categories, each in file order: 1st writing, 1st roleplay, ...
            by_category = [[p for p in mt if p["orig_category"] == c] for c in MT_BENCH_CATEGORIES]
            mt = [p for round_ in zip(*by_category) for p in round_]
        mt = mt[:num_per_category]
    rest = bench.load_prompts(path, groups={c: [c] for c in SPEC_BENCH_CATEGORIES}, num_per_category=num_per_category)
    return mt + rest


def specrs_configs(ngram_windows: list[tuple[int, int]], suffix_extra: dict, fixed_ks: list[int]) -> list[dict]:
    """Each method at each k with specrs' default adaptive draft length, plus vLLM's fixed draft
    length (every draft verified whole) at `fixed_ks`."""
    configs = []
    for low, high in ngram_windows:
        for k in K_VALUES:
            configs.append({"method": "ngram", "num_speculative_tokens": k,
                            "prompt_lookup_min": low, "prompt_lookup_max": high})
        for k in fixed_ks:
            configs.append({"method": "ngram", "num_speculative_tokens": k,
                            "prompt_lookup_min": low, "prompt_lookup_max": high, "adaptive_draft_length": False})
    for k in K_VALUES:
        configs.append({"method": "suffix", "num_speculative_tokens": k, **suffix_extra})
    for k in fixed_ks:
        configs.append({"method": "suffix", "num_speculative_tokens": k, **suffix_extra, "adaptive_draft_length": False})
    return configs


def llama_runners(model_path: str, threads: int, n_ctx: int, eos_ids: set[int],
                  plain_only: bool = False) -> list[bench.Runner]:
    """llama-cpp-python plain decoding and (unless `plain_only`) prompt lookup decoding for each k,
    as bench runners. Plain only holds one llama.cpp context, which runs at full speed with
    OpenMP's default (active) waiting; two contexts need OMP_WAIT_POLICY=passive, which costs the
    1.5B a third of its decode speed (33.5 -> 21.7 tok/s measured here), so the plain-only figures
    are the fair ones for plain decoding."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    common = dict(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
    plain = Llama(logits_all=False, **common)
    # llama-cpp-python forces logits_all=True whenever a draft model is set (verification needs the
    # logits of every drafted row); one such instance serves every k, its draft model set per run.
    with_draft = None if plain_only else Llama(
        logits_all=True, draft_model=LlamaPromptLookupDecoding(max_ngram_size=LLAMA_MAX_NGRAM,
                                                               num_pred_tokens=K_VALUES[0]), **common)

    # Llama.generate calls self.eval once per target forward (the prefill, then one per step with
    # the last token plus the draft); an instance attribute shadowing the method counts them.
    eval_sizes: list[int] = []

    def count_evals(llm):
        original = llm.eval

        def counted_eval(tokens):
            eval_sizes.append(len(tokens))
            return original(tokens)

        llm.eval = counted_eval

    count_evals(plain)
    if with_draft is not None:
        count_evals(with_draft)

    def make_run(k: int | None):
        def run(prompt: dict, max_tokens: int):
            llm = plain if k is None else with_draft
            if k is not None:
                llm.draft_model = LlamaPromptLookupDecoding(max_ngram_size=LLAMA_MAX_NGRAM, num_pred_tokens=k)
            # reset() empties the cache; otherwise generate() reuses the previous run's prompt prefix.
            llm.reset()
            eval_sizes.clear()
            yielded_per_eval: list[int] = []  # tokens yielded after each eval call
            token_ids, times = [], []
            start = time.perf_counter()
            generator = llm.generate(prompt["token_ids"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                     repeat_penalty=1.0, reset=True)
            for token in generator:
                times.append(time.perf_counter())
                while len(yielded_per_eval) < len(eval_sizes):
                    yielded_per_eval.append(0)
                yielded_per_eval[-1] += 1
                token_ids.append(token)
                if token in eos_ids or len(token_ids) >= max_tokens:
                    break
            generator.close()
            finish_reason = "stop" if token_ids and token_ids[-1] in eos_ids else "length"
            return llama_metrics(prompt, k, token_ids, times, start, eval_sizes, yielded_per_eval), token_ids, finish_reason

        return run

    runners = [bench.Runner("llama.cpp baseline", "llama.cpp", make_run(None), is_baseline=True)]
    for k in [] if plain_only else K_VALUES:
        runners.append(bench.Runner(f"llama.cpp pld k={k} ngram<={LLAMA_MAX_NGRAM}", "llama.cpp", make_run(k),
                                    num_speculative_tokens=k))
    return runners


def llama_metrics(prompt: dict, k: int | None, token_ids: list[int], times: list[float], start: float,
                  eval_sizes: list[int], yielded_per_eval: list[int]) -> dict:
    """specrs's metrics schema for one llama.cpp request."""
    n = len(token_ids)
    decode_s = times[-1] - times[0] if n > 1 else 0.0
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    # Every eval after the prefill feeds the last sampled token plus the draft; each yields the
    # accepted draft tokens plus one token of the target's own.
    drafted = [size - 1 for size in eval_sizes[1:]]
    accepted = [max(y - 1, 0) for y in yielded_per_eval[1:]]
    per_pos = [0] * (k or 0)
    for count in accepted:
        for i in range(min(count, len(per_pos))):
            per_pos[i] += 1
    drafts = sum(1 for d in drafted if d > 0)
    return {
        "num_prompt_tokens": len(prompt["token_ids"]),
        "num_generated_tokens": n,
        "num_forward_passes": len(eval_sizes),
        "ttft_s": times[0] - start if times else 0.0,
        "e2e_s": times[-1] - start if times else 0.0,
        "itl_s_mean": decode_s / (n - 1) if n > 1 else 0.0,
        "itl_s_p50": gaps[len(gaps) // 2] if gaps else 0.0,
        "itl_s_p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0,
        "decode_tokens_per_s": (n - 1) / decode_s if decode_s > 0 else 0.0,
        "prefill_tokens_per_s": len(prompt["token_ids"]) / (times[0] - start) if times else 0.0,
        "spec_method": None if k is None else "llama_cpp_prompt_lookup",
        "num_speculative_tokens": k or 0,
        "num_drafts": drafts,
        "num_draft_tokens": sum(drafted),
        "num_accepted_tokens": sum(accepted),
        "num_accepted_tokens_per_pos": per_pos,
        "mean_acceptance_length": 1 + sum(accepted) / drafts if drafts else 1.0,
        "acceptance_rate": sum(accepted) / sum(drafted) if sum(drafted) else 0.0,
    }


def cross_engine_table(summary: dict) -> str:
    """Overall decode tokens/s of every configuration against both engines' plain decoding."""
    overall = summary["overall"]
    llama_base = overall.get("llama.cpp baseline")
    lines = ["| config | decode tok/s | vs own baseline | vs llama.cpp plain | tokens per forward | same output as own baseline |",
             "|---|---|---|---|---|---|"]
    for label, agg in overall.items():
        vs_llama = agg["decode_tokens_per_s"] / llama_base["decode_tokens_per_s"] if llama_base else None
        matching = agg.get("num_matching_baseline")
        lines.append(f"| {label} | {agg['decode_tokens_per_s']:.1f} | {bench.fmt(agg['speedup'], '.2f', 'x')} | "
                     f"{bench.fmt(vs_llama, '.2f', 'x')} | {agg['tokens_per_forward']:.2f} | "
                     f"{'-' if matching is None else str(matching) + '/' + str(agg['num_requests'])} |")
    return "\n".join(lines)


def parse_window(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="Spec-Bench question.jsonl, or benches/code_workload.jsonl")
    ap.add_argument("--out", default="bench-results/spec_bench.json", help="JSON output path")
    ap.add_argument("--model", default=None,
                    help="GGUF path or a model name `specrs models` lists (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--num-per-category", type=int, default=10)
    ap.add_argument("--mt-bench", choices=["group", "spread", "split"], default="group",
                    help="MT-bench selection (see above); group = the anchors' prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="only the first N selected prompts (smoke runs)")
    ap.add_argument("--ngram-window", default="2:4",
                    help="comma list of prompt_lookup_min:prompt_lookup_max; each gets k in {2,4,8}")
    ap.add_argument("--fixed-k", default="4",
                    help="comma list of k also run with a fixed draft length (vLLM's behaviour); '' for none")
    ap.add_argument("--suffix-extra", default="{}", metavar="JSON",
                    help="extra keys for every suffix config, e.g. '{\"suffix_decoding_max_cached_requests\": 0}'")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (default: all CPUs)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-cpp-python even when importable")
    ap.add_argument("--llama-plain-only", action="store_true",
                    help="run llama.cpp's plain decoding only (one context: run without OMP_WAIT_POLICY=passive)")
    ap.add_argument("--configs", default=None, metavar="JSON",
                    help="a JSON list of speculative configs to run instead of the ngram/suffix grid, e.g. "
                         "'[{\"method\": \"auto\", \"model\": \"qwen2.5-coder-0.5b\"}]'")
    ap.add_argument("--plot", default=None, metavar="OUT.png", help="speedup and acceptance plot (needs matplotlib)")
    ap.add_argument("--no-chat", action="store_true",
                    help="prompts as plain text, for a base model without a chat template (gemma3-270m)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()

    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail now, not after the whole run)
        except ImportError:
            raise SystemExit("--plot needs matplotlib: `pip install matplotlib`") from None
    windows = [parse_window(w) for w in args.ngram_window.split(",") if w.strip()]
    suffix_extra = json.loads(args.suffix_extra)
    if not isinstance(suffix_extra, dict):
        raise SystemExit("--suffix-extra must be a JSON object")
    fixed_ks = [int(k) for k in args.fixed_k.split(",") if k.strip()]
    configs = specrs_configs(windows, suffix_extra, fixed_ks) if args.configs is None else json.loads(args.configs)
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise SystemExit("--configs must be a JSON list of objects")
    prompts = select_prompts(args.prompts, args.num_per_category, args.mt_bench)
    if args.limit:
        prompts = prompts[: args.limit]

    model_path = specrs.models.resolve_model(args.model)  # a path, or a name `specrs models` lists
    engine = specrs.Engine(model_path)
    prompts = bench.tokenize_prompts(engine, prompts, args.max_tokens, chat=not args.no_chat)
    params = specrs.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    runners = [bench.specrs_runner(engine, None, params)] + [bench.specrs_runner(engine, c, params) for c in configs]

    llama_version = None
    if not args.no_llama:
        try:
            import llama_cpp
        except ImportError:
            print("llama_cpp is not importable: running specrs only", file=sys.stderr)
        else:
            llama_version = llama_cpp.__version__
            eos_ids = set(engine.tokenizer.eos_token_ids)
            runners += llama_runners(model_path, args.threads, bench.DEFAULT_MAX_CONTEXT, eos_ids,
                                     plain_only=args.llama_plain_only)
    bench.check_unique_labels(runners)

    print(f"{len(prompts)} prompts ({sum(p['truncated'] for p in prompts)} cut to fit), {len(runners)} configurations, "
          f"{args.max_tokens} tokens, llama.cpp threads {args.threads}", file=sys.stderr)
    records = bench.run_benchmark(prompts, runners, args.max_tokens, greedy=True, progress=not args.no_progress)
    verify_cost = engine.verify_cost_ratios(max(K_VALUES) + 1)
    summary = bench.summarize(records, runners, {"specrs": verify_cost})

    print(bench.format_tables(summary))
    print("\nBoth engines, all prompts:\n")
    print(cross_engine_table(summary))
    print("\nspecrs verify cost v(n) = t(n)/t(1) at a 512-token context: "
          + " ".join(f"{n}:{v:.2f}" for n, v in enumerate(verify_cost, 1)))

    configs_by_label: dict = {r.label: c for r, c in zip(runners, [None] + configs)}
    for r in runners:
        if r.engine_name == "llama.cpp":
            configs_by_label[r.label] = {"engine": "llama-cpp-python", "num_pred_tokens": r.num_speculative_tokens or None,
                                         "max_ngram_size": LLAMA_MAX_NGRAM if r.num_speculative_tokens else None}
    report = bench.make_report(engine, args, prompts, configs_by_label, records, summary, verify_cost)
    report["versions"]["llama_cpp_python"] = llama_version
    report["llama_cpp"] = {"threads": args.threads, "n_ctx": bench.DEFAULT_MAX_CONTEXT, "max_ngram_size": LLAMA_MAX_NGRAM}
    bench.write_json(args.out, report)
    print(f"\nwrote {args.out}", file=sys.stderr)
    if args.plot:
        bench.write_plot(summary, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
