"""Foundation benchmark: specrs vs llama-cpp-python on the same GGUF files, same threads, same
prompts, interleaved in one process.

Per model:
1. Prefill and decode tokens/s at a 512-token context (64 greedy tokens, EOS ignored), each
   engine once per prompt and repeat, alternating which goes first.
2. Verification cost curve: the time of one forward over n new tokens (n = 1..17) on top of a
   512-token cache, divided by the time for n = 1. llama.cpp computes logits for every row
   (logits_all=True), as verification needs. Each repeat times every n on both engines in turn
   (specrs: the median of 3 forwards, llama.cpp likewise).

Every figure is reported as min and median over the repeats (for tokens/s the min is the slowest
run); ratios are of medians. Beside decode tokens/s: the weight bytes one step reads (specrs:
`Engine.info()["step_weight_bytes"]`, what its kernels hold; llama.cpp: the GGUF's tensors less the
embedding table when an output matrix is separate) and the implied read bandwidth.

Usage (a Python with specrs and llama-cpp-python; see benches/README.md):
    python benches/foundation.py --spec-bench ../shared/data/spec_bench/question.jsonl \\
        --model smollm2=smollm2-135m --model gemma3=gemma3-270m --out bench-results/foundation.json
    python benches/foundation.py --model 1b-q4_0=/tmp/llama-1b-q4_0.gguf ...   # scripts/make_random_llama_gguf.py
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
NS = list(range(1, 18))
INNER = 3  # forwards per (repeat, n) and engine; their median is the repeat's figure


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
    out = engine.generate(ctx, specrs.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return CONTEXT / out.metrics["ttft_s"], out.metrics["decode_tokens_per_s"]


def llama_forward_cost(llm_all, ctx: list[int], ns: list[int]) -> dict[int, float]:
    """Median of INNER forwards over n tokens after the context, per n."""
    llm_all.reset()
    llm_all.eval(ctx)
    probe = ctx[-max(ns):]
    out = {}
    for n in ns:
        times = []
        for _ in range(INNER):
            llm_all._ctx.kv_cache_seq_rm(-1, len(ctx), -1)
            llm_all.n_tokens = len(ctx)
            t0 = time.perf_counter()
            llm_all.eval(probe[:n])
            times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times)
    return out


def gguf_step_bytes(path: str) -> int:
    """Bytes of the GGUF's tensors a llama.cpp step reads: all but the token embedding table,
    which a step gathers one row of, unless it is also the (tied) output matrix."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def stats(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "runs": xs}


def bench_model(name: str, path: str, args, Llama) -> dict:
    from specrs.models import resolve_model

    gguf_path = resolve_model(path)
    engine = specrs.Engine(gguf_path)
    common = dict(model_path=gguf_path, n_ctx=2048, n_batch=512, n_threads=args.threads,
                  n_threads_batch=args.threads, verbose=False, seed=0)
    llm = Llama(logits_all=False, **common)
    llm_all = Llama(logits_all=True, **common)
    ctxs = contexts(engine.tokenizer, args.spec_bench, args.prompts)

    runs = {"specrs": {"prefill": [], "decode": []}, "llama.cpp": {"prefill": [], "decode": []}}
    if not args.skip_decode:
        for rep in range(args.repeats):
            for i, ctx in enumerate(ctxs):
                order = ["specrs", "llama.cpp"] if (i + rep) % 2 == 0 else ["llama.cpp", "specrs"]
                for e in order:
                    prefill, decode = specrs_decode(engine, ctx) if e == "specrs" else llama_decode(llm, ctx)
                    runs[e]["prefill"].append(prefill)
                    runs[e]["decode"].append(decode)
                    print(f"{name} repeat {rep} prompt {i} {e:9s} prefill {prefill:7.1f} tok/s  decode {decode:6.1f} tok/s",
                          flush=True)

    curve_runs = {"specrs": {n: [] for n in NS}, "llama.cpp": {n: [] for n in NS}}
    ctx = ctxs[0]
    for rep in range(args.repeats):
        order = ["specrs", "llama.cpp"] if rep % 2 == 0 else ["llama.cpp", "specrs"]
        for e in order:
            cost = dict(engine.forward_cost(ctx, NS, repeats=INNER)) if e == "specrs" else llama_forward_cost(llm_all, ctx, NS)
            for n in NS:
                curve_runs[e][n].append(cost[n])
        print(f"{name} curve repeat {rep}: specrs t(1) {curve_runs['specrs'][1][-1] * 1e3:.1f} ms, "
              f"llama.cpp t(1) {curve_runs['llama.cpp'][1][-1] * 1e3:.1f} ms", flush=True)

    result = {"path": os.path.basename(gguf_path), "engines": {}}
    step_bytes = {"specrs": engine.info()["step_weight_bytes"], "llama.cpp": gguf_step_bytes(gguf_path)}
    for e in ("specrs", "llama.cpp"):
        med = {n: statistics.median(curve_runs[e][n]) for n in NS}
        result["engines"][e] = {
            "curve_ms": {n: stats([t * 1e3 for t in curve_runs[e][n]]) for n in NS},
            "curve_ratio": {n: med[n] / med[1] for n in NS},
        }
        if not args.skip_decode:
            result["engines"][e]["prefill_tok_s"] = stats(runs[e]["prefill"])
            result["engines"][e]["decode_tok_s"] = stats(runs[e]["decode"])
            result["engines"][e]["step_weight_bytes"] = step_bytes[e]
            result["engines"][e]["decode_read_gb_s"] = step_bytes[e] * result["engines"][e]["decode_tok_s"]["median"] / 1e9
    s, l = result["engines"]["specrs"], result["engines"]["llama.cpp"]
    if not args.skip_decode:
        result["decode_ratio"] = s["decode_tok_s"]["median"] / l["decode_tok_s"]["median"]
        result["prefill_ratio"] = s["prefill_tok_s"]["median"] / l["prefill_tok_s"]["median"]
    result["t1_ratio_llamacpp_over_specrs"] = l["curve_ms"][1]["median"] / s["curve_ms"][1]["median"]

    print(f"\n{name} ({result['path']}), {CONTEXT}-token context, {args.threads} threads, {args.repeats} repeats:")
    if not args.skip_decode:
        for e in ("specrs", "llama.cpp"):
            r = result["engines"][e]
            print(f"  {e:9s} prefill {r['prefill_tok_s']['median']:7.1f} tok/s (min {r['prefill_tok_s']['min']:.1f})  "
                  f"decode {r['decode_tok_s']['median']:6.1f} tok/s (min {r['decode_tok_s']['min']:.1f}), "
                  f"{r['step_weight_bytes'] / 1e6:.1f} MB/step = {r['decode_read_gb_s']:.1f} GB/s")
        print(f"  decode ratio specrs / llama.cpp: {result['decode_ratio']:.2f}x; prefill ratio: {result['prefill_ratio']:.2f}x")
    print("  verification cost t(n)/t(1) at a 512-token cache (medians):")
    print("  n        " + "".join(f"{n:>6d}" for n in NS))
    for e in ("specrs", "llama.cpp"):
        r = result["engines"][e]
        print(f"  {e:9s}" + "".join(f"{r['curve_ratio'][n]:6.2f}" for n in NS) +
              f"   t(1) = {r['curve_ms'][1]['median']:.1f} ms (min {r['curve_ms'][1]['min']:.1f})")
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=[],
                    help="NAME=PATH_OR_SPECRS_NAME (repeatable; default smollm2=smollm2-135m)")
    ap.add_argument("--spec-bench", default=None, help="Spec-Bench question.jsonl (long prompts)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-decode", action="store_true", help="only the verification curve")
    ap.add_argument("--out", default="bench-results/foundation.json")
    args = ap.parse_args()

    from llama_cpp import Llama
    import llama_cpp

    models = [m.split("=", 1) for m in (args.model or ["smollm2=smollm2-135m"])]
    out = {"context_tokens": CONTEXT, "new_tokens": NEW_TOKENS, "threads": args.threads, "repeats": args.repeats,
           "llama_cpp_python": llama_cpp.__version__, "specrs": specrs.__version__,
           "cpu_kernels": os.environ.get("SPECRS_CPU_KERNELS", "default"), "models": {}}
    for name, path in models:
        out["models"][name] = bench_model(name, path, args, Llama)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
