"""Foundation benchmark: specrs vs llama-cpp-python on the same GGUF, same threads, same prompts,
interleaved in one process.

1. Prefill and decode tokens/s at a 512-token context (64 greedy tokens, EOS ignored).
2. Verification cost curve: time of one forward over n new tokens (n = 1, 2, 3, 5, 9, 17) on top
   of a 512-token cache, divided by the time for n = 1. llama.cpp computes logits for every row
   (logits_all=True), as verification needs.

Usage (a Python with specrs and llama-cpp-python; see benches/README.md):
    python benches/foundation.py --spec-bench ../shared/data/spec_bench/question.jsonl \
        --out bench-results/foundation.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

import specrs

CONTEXT = 512
NEW_TOKENS = 64
NS = [1, 2, 3, 5, 9, 17]


def contexts(tokenizer, spec_bench: str | None, count: int) -> list[list[int]]:
    """`count` token contexts of exactly CONTEXT tokens from long Spec-Bench prompts."""
    texts = []
    if spec_bench:
        rows = [json.loads(l) for l in open(spec_bench, encoding="utf-8") if l.strip()]
        texts = [r["turns"][0] for r in rows if r["category"] in ("summarization", "rag")]
    texts += ["The quick brown fox jumps over the lazy dog. " * 200]
    out = []
    for t in texts:
        ids = tokenizer.encode(t)
        if len(ids) >= CONTEXT:
            out.append(ids[:CONTEXT])
        if len(out) == count:
            break
    return out


def llama_decode(llm, ctx: list[int]) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of greedy decoding with llama.cpp's own per-token path."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ctx)
    n_vocab = llm.n_vocab()
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
    tok = int(np.argmax(logits))
    t1 = time.perf_counter()
    for _ in range(NEW_TOKENS - 1):
        llm.eval([tok])
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        tok = int(np.argmax(logits))
    t2 = time.perf_counter()
    return CONTEXT / (t1 - t0), (NEW_TOKENS - 1) / (t2 - t1)


def specrs_decode(engine, ctx: list[int]) -> tuple[float, float]:
    out = engine.generate(ctx, specrs.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    return CONTEXT / out.metrics["ttft_s"], out.metrics["decode_tokens_per_s"]


def llama_forward_cost(llm_all, ctx: list[int], repeats: int) -> dict[int, float]:
    llm_all.reset()
    llm_all.eval(ctx)
    probe = ctx[-max(NS):]
    times = {n: [] for n in NS}
    for _ in range(repeats):
        for n in NS:
            llm_all._ctx.kv_cache_seq_rm(-1, len(ctx), -1)
            llm_all.n_tokens = len(ctx)
            t0 = time.perf_counter()
            llm_all.eval(probe[:n])
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--spec-bench", default=None, help="Spec-Bench question.jsonl (long prompts)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-results/foundation.json")
    args = ap.parse_args()

    from llama_cpp import Llama
    import llama_cpp

    path = args.model or specrs.default_model_path()
    engine = specrs.Engine(path)
    common = dict(model_path=path, n_ctx=2048, n_batch=512, n_threads=args.threads, n_threads_batch=args.threads,
                  verbose=False, seed=0)
    llm = Llama(logits_all=False, **common)
    llm_all = Llama(logits_all=True, **common)
    ctxs = contexts(engine.tokenizer, args.spec_bench, args.prompts)

    rows = []
    for i, ctx in enumerate(ctxs):
        order = ["specrs", "llama.cpp"] if i % 2 == 0 else ["llama.cpp", "specrs"]
        for name in order:
            prefill, decode = specrs_decode(engine, ctx) if name == "specrs" else llama_decode(llm, ctx)
            rows.append({"prompt": i, "engine": name, "prefill_tok_s": prefill, "decode_tok_s": decode})
            print(f"prompt {i} {name:9s} prefill {prefill:7.1f} tok/s  decode {decode:6.1f} tok/s", flush=True)

    def mean(engine_name, key):
        return statistics.mean(r[key] for r in rows if r["engine"] == engine_name)

    summary = {e: {"prefill_tok_s": mean(e, "prefill_tok_s"), "decode_tok_s": mean(e, "decode_tok_s")}
               for e in ("specrs", "llama.cpp")}
    summary["decode_ratio_specrs_over_llamacpp"] = summary["specrs"]["decode_tok_s"] / summary["llama.cpp"]["decode_tok_s"]
    summary["prefill_ratio_specrs_over_llamacpp"] = summary["specrs"]["prefill_tok_s"] / summary["llama.cpp"]["prefill_tok_s"]

    ctx = ctxs[0]
    spec_cost = dict(engine.forward_cost(ctx, NS, repeats=args.repeats))
    llama_cost = llama_forward_cost(llm_all, ctx, args.repeats)
    curve = {
        "n": NS,
        "specrs_ms": [spec_cost[n] * 1e3 for n in NS],
        "specrs_ratio": [spec_cost[n] / spec_cost[1] for n in NS],
        "llamacpp_ms": [llama_cost[n] * 1e3 for n in NS],
        "llamacpp_ratio": [llama_cost[n] / llama_cost[1] for n in NS],
    }

    print(f"\nmean over {len(ctxs)} prompts at a {CONTEXT}-token context, {args.threads} threads:")
    for e in ("specrs", "llama.cpp"):
        print(f"  {e:9s} prefill {summary[e]['prefill_tok_s']:7.1f} tok/s  decode {summary[e]['decode_tok_s']:6.1f} tok/s")
    print(f"  decode ratio specrs / llama.cpp: {summary['decode_ratio_specrs_over_llamacpp']:.2f}x; "
          f"prefill ratio: {summary['prefill_ratio_specrs_over_llamacpp']:.2f}x")
    print("\nverification cost t(n)/t(1) at a 512-token cache:")
    print("  n        " + "".join(f"{n:>8d}" for n in NS))
    print("  specrs   " + "".join(f"{r:8.2f}" for r in curve["specrs_ratio"]) + f"   (t(1) = {curve['specrs_ms'][0]:.1f} ms)")
    print("  llama.cpp" + "".join(f"{r:8.2f}" for r in curve["llamacpp_ratio"]) + f"   (t(1) = {curve['llamacpp_ms'][0]:.1f} ms)")

    out = {"context_tokens": CONTEXT, "new_tokens": NEW_TOKENS, "threads": args.threads,
           "llama_cpp_python": llama_cpp.__version__, "specrs": specrs.__version__, "model": os.path.basename(path),
           "runs": rows, "summary": summary, "verification_cost": curve}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
