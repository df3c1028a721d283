"""Structured-output bench (issue 24): constrained decoding with and without speculation, and the
grammar's forced tokens as free drafts, on SmolLM2-135M-Instruct, greedy and at temperature 0.7,
in one process, configurations interleaved per prompt.

Workload (written here, over Spec-Bench passages): the first `--num-per-category` first-turn
prompts of Spec-Bench's summarization and rag categories, each cut to `--passage-chars`, in two
tasks:
- extract: the passage's title, topic, three key points, entities and sentiment as a JSON object
  (EXTRACT_SCHEMA: fixed keys, an enum, bounded strings and arrays);
- tool_call: the arguments of a `search_documents` tool call about the passage (TOOL_SCHEMA:
  nested object, integer range, enum), as a tool call's JSON.

Configurations (speculative_config; every one constrained by the task's schema):
- plain: no speculation (plain constrained decoding, the baseline);
- ngram_checked / suffix_checked: n-gram (k=4) / suffix decoding drafts, cut where the grammar
  forbids them, without the grammar's forced run ("grammar_drafts": false);
- ngram_forced / suffix_forced: the same with the grammar's forced tokens opening each draft;
- ngram_tree_checked / ngram_tree_forced (only with --configs): n-gram token trees of 8 nodes,
  without and with the forced run as their trunk.

Figures per configuration and temperature: decode tokens/s (generated tokens over decode time,
summed over prompts), speedup over plain on the same prompts, mean accepted tokens per draft step
(1 + accepted / drafts), the share of accepted tokens the grammar forced, validity (the output
parses as JSON and validates against its schema; goal 100%), and at greedy whether every output
equals plain decoding's (it must).

    python benches/structured_bench.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --out bench-results/structured_bench.json

Smoke run: --num-per-category 1 --max-tokens 32 --temperatures 0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


import specrs
from specrs import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_workload import EXTRACT_SCHEMA, TASKS, load_passages, valid  # noqa: E402  (benches/ is no package)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
NGRAM_TREE = {"method": "ngram", "num_speculative_tokens": 8, "tree": True, "prompt_lookup_min": 2,
              "prompt_lookup_max": 4}
CONFIGS = {
    "plain": False,
    "ngram_checked": NGRAM | {"grammar_drafts": False},
    "ngram_forced": NGRAM,
    "suffix_checked": SUFFIX | {"grammar_drafts": False},
    "suffix_forced": SUFFIX,
    # Token trees (8 nodes), the forced run as their trunk; run with --configs.
    "ngram_tree_checked": NGRAM_TREE | {"grammar_drafts": False},
    "ngram_tree_forced": NGRAM_TREE,
}
DEFAULT_CONFIGS = ["plain", "ngram_checked", "ngram_forced", "suffix_checked", "suffix_forced"]


def run(args) -> dict:
    passages = load_passages(args.prompts, args.num_per_category, args.passage_chars)
    configs = {name: CONFIGS[name] for name in args.configs}
    rows = []
    for temperature in args.temperatures:
        engine = specrs.Engine(args.model)  # one per temperature: suffix decoding caches answers
        for config in configs.values():  # warm-up: the cost curve, the grammar compiler, the caches
            p = SamplingParams(max_tokens=8, temperature=temperature, seed=0, json_schema=EXTRACT_SCHEMA)
            engine.generate([{"role": "user", "content": "Warm up."}], p, speculative_config=config)
        for i, passage in enumerate(passages):
            for task, (schema, template) in TASKS.items():
                messages = [{"role": "user", "content": template.format(passage=passage["passage"])}]
                params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=1000 + i,
                                        json_schema=schema)
                for name, config in configs.items():
                    start = time.perf_counter()
                    out = engine.generate(messages, params, speculative_config=config)
                    wall = time.perf_counter() - start
                    m = out.metrics
                    rows.append({
                        "temperature": temperature, "question_id": passage["question_id"],
                        "category": passage["category"], "task": task, "config": name,
                        "new_tokens": len(out.token_ids), "decode_s": m["e2e_s"] - m["ttft_s"], "wall_s": wall,
                        "num_drafts": m["num_drafts"], "num_accepted_tokens": m["num_accepted_tokens"],
                        "num_grammar_draft_tokens": m["num_grammar_draft_tokens"],
                        "num_grammar_accepted_tokens": m["num_grammar_accepted_tokens"],
                        "num_grammar_cut_tokens": m["num_grammar_cut_tokens"],
                        "finish_reason": out.finish_reason, "valid": valid(out.text, schema),
                        "token_ids": out.token_ids,
                    })
                print(f"T={temperature} {i + 1}/{len(passages)} {passage['category']} done", flush=True)
        del engine
    return {"rows": rows, "summary": summarize(rows, list(configs))}


def summarize(rows: list[dict], names: list[str]) -> list[dict]:
    out = []
    for temperature in sorted({r["temperature"] for r in rows}):
        at_t = [r for r in rows if r["temperature"] == temperature]
        plain = {(r["question_id"], r["task"]): r for r in at_t if r["config"] == "plain"}
        plain_tps = sum(r["new_tokens"] for r in plain.values()) / sum(r["decode_s"] for r in plain.values())
        for name in names:
            mine = [r for r in at_t if r["config"] == name]
            tps = sum(r["new_tokens"] for r in mine) / sum(r["decode_s"] for r in mine)
            drafts = sum(r["num_drafts"] for r in mine)
            accepted = sum(r["num_accepted_tokens"] for r in mine)
            out.append({
                "temperature": temperature, "config": name, "num_requests": len(mine),
                "decode_tokens_per_s": round(tps, 1), "speedup_vs_plain": round(tps / plain_tps, 3),
                "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
                "grammar_share_of_accepted": round(sum(r["num_grammar_accepted_tokens"] for r in mine)
                                                   / accepted, 3) if accepted else 0.0,
                "grammar_draft_acceptance": round(sum(r["num_grammar_accepted_tokens"] for r in mine)
                                                  / max(1, sum(r["num_grammar_draft_tokens"] for r in mine)), 3),
                "num_grammar_cut_tokens": sum(r["num_grammar_cut_tokens"] for r in mine),
                "validity": round(sum(r["valid"] for r in mine) / len(mine), 3),
                "num_length_cut": sum(r["finish_reason"] == "length" for r in mine),
                "identical_to_plain": (sum(r["token_ids"] == plain[(r["question_id"], r["task"])]["token_ids"]
                                           for r in mine) if temperature == 0 else None),
            })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="Spec-Bench question.jsonl")
    parser.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-per-category", type=int, default=6)
    parser.add_argument("--passage-chars", type=int, default=1500)
    # 512: every answer of this workload completes (the longest greedy one is 246 tokens), so validity
    # counts the grammar, not a length cut.
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS),
                        help="configurations to run ('plain' is the baseline every ratio needs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if "plain" not in args.configs:
        parser.error("--configs needs 'plain', the baseline every ratio is taken against")
    result = run(args)
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "specrs": specrs.__version__}
    result["args"] = vars(args)
    for row in result["summary"]:
        print(json.dumps(row))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
