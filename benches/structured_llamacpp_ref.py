"""llama.cpp reference for structured_bench.py: llama-cpp-python's JSON-schema mode
(`response_format={"type": "json_object", "schema": ...}`, a GBNF grammar built from the schema)
on the same prompts, greedy and at temperature 0.7, plain decoding (llama-cpp-python has no
speculation under a grammar). Run it in the anchors' venv (../shared/anchors/setup.sh llamacpp,
plus `pip install jsonschema`), never beside another benchmark:

    /path/to/anchors/.venv/bin/python benches/structured_llamacpp_ref.py \\
        --prompts ../shared/data/spec_bench/question.jsonl --model SmolLM2.gguf \\
        --out bench-results/structured_llamacpp_ref.json

Figures: decode tokens/s (tokens after the first over the time after the first, summed), validity
(parses and validates against the schema), as structured_bench.py reports them.
"""

import argparse
import json
import os
import sys
import time

from llama_cpp import Llama

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_workload import TASKS, load_passages, valid  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--model", required=True, help="the GGUF file structured_bench.py ran")
    parser.add_argument("--num-per-category", type=int, default=6)
    parser.add_argument("--passage-chars", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = Llama(model_path=args.model, n_ctx=4096, n_threads=args.threads, n_batch=512, verbose=False)
    passages = load_passages(args.prompts, args.num_per_category, args.passage_chars)
    rows = []
    for temperature in args.temperatures:
        for i, passage in enumerate(passages):
            for task, (schema, template) in TASKS.items():
                messages = [{"role": "user", "content": template.format(passage=passage["passage"])}]
                start = time.perf_counter()
                first_s, text, chunks = None, "", 0
                for chunk in llm.create_chat_completion(
                        messages, response_format={"type": "json_object", "schema": schema},
                        temperature=temperature, max_tokens=args.max_tokens, seed=1000 + i, stream=True):
                    delta = chunk["choices"][0]["delta"].get("content")
                    if delta:
                        first_s = first_s or time.perf_counter()
                        text += delta
                        chunks += 1
                end = time.perf_counter()
                new_tokens = len(llm.tokenize(text.encode(), add_bos=False, special=False))
                rows.append({"temperature": temperature, "question_id": passage["question_id"], "task": task,
                             "new_tokens": new_tokens, "ttft_s": (first_s or end) - start,
                             "decode_s": end - (first_s or end), "valid": valid(text, schema)})
            print(f"T={temperature} {i + 1}/{len(passages)}", flush=True)
    summary = []
    for temperature in args.temperatures:
        mine = [r for r in rows if r["temperature"] == temperature]
        tps = sum(r["new_tokens"] - 1 for r in mine) / sum(r["decode_s"] for r in mine)
        summary.append({"temperature": temperature, "engine": "llama-cpp-python json_schema",
                        "num_requests": len(mine), "decode_tokens_per_s": round(tps, 1),
                        "validity": round(sum(r["valid"] for r in mine) / len(mine), 3)})
        print(json.dumps(summary[-1]))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "summary": summary, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
