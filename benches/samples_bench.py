"""`n` > 1 bench (issue 24): n samples of one prompt with the prompt's prefill shared
(`Scheduler.add_samples`, what `Engine.generate_samples` and `specrs serve` run for `n`) against
the same n requests added separately (each reads the whole prompt), in one process, on
SmolLM2-135M-Instruct, configurations interleaved per prompt.

Workload: the first `--num-prompts` Spec-Bench first turns of the summarization and rag
categories (long prompts: where a shared prefill matters), chat-templated; n samples at
temperature `--temperature`, seeds 1000 + prompt index (+ sample index), `--max-tokens` each.

Figures per configuration (speculation off / n-gram / suffix, each shared and separate): wall
seconds for all samples of all prompts, generated tokens/s over that wall time, mean time to the
first token of a sample, forward rows computed, prompt positions copied instead of computed, and
whether every sample equals the separate run's (it must: sharing changes no token). Suffix
decoding learns from every finished response: each mode gets its own engine-wide suffix cache
(configs differing only in `suffix_decoding_max_cached_requests`), so neither drafts from the
other's outputs of the same prompt and seeds.

    python benches/samples_bench.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --out bench-results/samples_bench.json

Smoke run: --num-prompts 1 --max-tokens 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import specrs
from specrs import SamplingParams, _specrs

CATEGORIES = ("summarization", "rag")
SPECULATION = {
    "off": False,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}


def load_prompts(path: str, num_prompts: int) -> list[str]:
    prompts = []
    with open(path) as f:
        for line in f:
            q = json.loads(line)
            if q["category"] in CATEGORIES:
                prompts.append(q["turns"][0])
    return prompts[:num_prompts]


def run_once(engine: specrs.Engine, prompt_ids: list[int], params: SamplingParams, speculative_config,
             shared: bool) -> dict:
    """All n samples of one prompt through a fresh scheduler: tokens per sample and timings."""
    config, proposer = engine._speculation(speculative_config, None)
    scheduler = _specrs.Scheduler(engine._inner)
    ids = list(range(params.n))
    start = time.perf_counter()
    if shared:
        scheduler.add_samples(ids, prompt_ids, params, config, proposer)
    else:
        for i in ids:
            seed = None if params.seed is None else params.seed + i
            one = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                 seed=seed)
            scheduler.add(i, prompt_ids, one, config, proposer)
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    first_token_s: dict[int, float] = {}
    while scheduler.has_unfinished:
        outputs, _ = scheduler.step()
        now = time.perf_counter() - start
        for output in outputs:
            if output["error"] is not None:
                raise output["error"]
            if output["token_ids"] and output["request_id"] not in first_token_s:
                first_token_s[output["request_id"]] = now
            tokens[output["request_id"]].extend(output["token_ids"])
    wall_s = time.perf_counter() - start
    totals = scheduler.totals()
    return {"tokens": [tokens[i] for i in ids], "wall_s": wall_s,
            "ttft_s": sum(first_token_s.values()) / len(first_token_s), "num_rows": totals["num_rows"],
            "num_shared_prompt_tokens": totals["num_shared_prompt_tokens"],
            "num_draft_tokens": totals["num_draft_tokens"], "num_accepted_tokens": totals["num_accepted_tokens"]}


def run(args) -> dict:
    engine = specrs.Engine()
    prompts = load_prompts(args.prompts, args.num_prompts)
    sums: dict[str, dict] = {}
    identical: dict[str, bool] = {}
    for index, text in enumerate(prompts):
        prompt_ids = engine.prompt_token_ids([{"role": "user", "content": text}])
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=0.95,
                                seed=1000 + index, n=args.n)
        for name, speculative_config in SPECULATION.items():
            runs = {}
            for shared in (False, True):
                label = f"{name}_{'shared' if shared else 'separate'}"
                config = speculative_config
                if name == "suffix":  # one engine-wide suffix cache per mode (see the header)
                    config = speculative_config | {"suffix_decoding_max_cached_requests": 10_000 + shared}
                runs[shared] = out = run_once(engine, prompt_ids, params, config, shared)
                s = sums.setdefault(label, {"wall_s": 0.0, "ttft_s": 0.0, "num_tokens": 0, "num_rows": 0,
                                            "num_prompt_tokens": 0, "num_shared_prompt_tokens": 0,
                                            "num_draft_tokens": 0, "num_accepted_tokens": 0})
                s["wall_s"] += out["wall_s"]
                s["ttft_s"] += out["ttft_s"] / len(prompts)
                s["num_tokens"] += sum(len(t) for t in out["tokens"])
                s["num_prompt_tokens"] += len(prompt_ids) * args.n
                for key in ("num_rows", "num_shared_prompt_tokens", "num_draft_tokens", "num_accepted_tokens"):
                    s[key] += out[key]
            identical[name] = identical.get(name, True) and runs[True]["tokens"] == runs[False]["tokens"]
        print(f"prompt {index}: {len(prompt_ids)} tokens", flush=True)
    rows = []
    for label, s in sums.items():
        name = label.rsplit("_", 1)[0]
        separate = sums[f"{name}_separate"]
        rows.append({"config": label, "wall_s": round(s["wall_s"], 3),
                     "tok_per_s": round(s["num_tokens"] / s["wall_s"], 1),
                     "speedup_vs_separate": round(separate["wall_s"] / s["wall_s"], 3),
                     "mean_ttft_ms": round(1000 * s["ttft_s"], 1), "num_rows": s["num_rows"],
                     "num_prompt_tokens": s["num_prompt_tokens"],
                     "num_shared_prompt_tokens": s["num_shared_prompt_tokens"],
                     "acceptance_rate": round(s["num_accepted_tokens"] / s["num_draft_tokens"], 3)
                     if s["num_draft_tokens"] else None,
                     "identical_to_separate": identical[name]})
    return {"workload": {"num_prompts": len(prompts), "n": args.n, "max_tokens": args.max_tokens,
                         "temperature": args.temperature,
                         "mean_prompt_tokens": round(sums["off_shared"]["num_prompt_tokens"] / args.n / len(prompts))},
            "rows": rows,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "specrs": specrs.__version__}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="Spec-Bench question.jsonl")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--out", help="write the JSON here as well")
    args = parser.parse_args()
    result = run(args)
    for row in result["rows"]:
        print(json.dumps(row))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
