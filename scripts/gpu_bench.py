#!/usr/bin/env python3
"""The GPU step's device benchmark (issue 42), sized for ONE call of a lent GPU machine (at most
8 minutes; --budget-s, default 450 s, keeps it well inside).

    python3 scripts/gpu_bench.py --wheel dist-cuda/specrs-*.whl [--out DIR] [--device cuda|cpu]
                                 [--tokens N] [--budget-s S] [--kv-layout paged|contiguous]

On a Llama-3-8B-shaped bf16 model with random weights (`specrs.Engine.random("llama3-8b")`), its
KV cache in the paged layout by default (a pool sized for batch 32; each layer writes and attends
every request's rows in one kernel each, cuda/paged_attention.cu), or the contiguous one:

(1) bound: the device's read bandwidth (`read_bandwidth`: a read-only reduction, best of 10
    passes over 2 GiB) and the bytes one single-row decode step reads at a context
    (`step_read_bytes`: the weights but the embedding table, plus the KV cache); their quotient is
    the fastest a token can come, taken at the mean context of the timed batch-1 run (prompt +
    half the generated tokens);
(2) kernels against references on the device: scripts/gpu_check.py's part (b) (acceptance, tree
    acceptance and n-gram kernels against their CPU references) and `check_decoder_kernels`
    (each fused kernel, the paged KV write and the paged attention against their references);
(3) identity: greedy speculative decoding (a replay proposer, k = 4, a = 0.9) against plain greedy
    decoding (a divergence whose two logits lie within gpu_check.NEAR_TIE of the largest is a
    near-tie, reported, not a failure); a seeded request (T = 0.8) run twice plain gives the same
    tokens; the same request speculative against plain (a divergence is a failure unless the draw
    fell on the CDF boundary between neighbouring ids: gpu_check.draw_near_tie);
(4) ITL at batch 1 (plain greedy, N tokens, time per token after the first) against the bound
    (goal <= 1.6x: printed, not a failure), with the engine's steps replayed from CUDA graphs (a
    paged engine on CUDA captures them: model/candle/step_graphs.rs) and, beside it, run eagerly;
(7) captured steps: for every (batch, rows) shape steps are padded to (model/candle/step_shape.rs),
    one `forward_batch` of that many sequences (each after a 4-token prefix) run three times: its
    key's first step eager, its second captured (run eagerly over the graph's own buffer), its
    third replayed; the replay's logits against the first run's (bitwise, or within
    GRAPH_TOLERANCE of the largest logit: a failure past it, as is a step that did not replay or
    a capture that failed), and the graphs' node count per layer and memory estimate;
(8) the asynchronous loop's timeline: batch 8 of plain greedy requests through the core scheduler's
    launch/finish halves, the step before's outputs decoded to text between them (as the server's
    loop sends them); per step the host's seconds in launch, between launch and finish (the work
    done while the device runs the step), in finish (the wait for the step's one download, then
    the commits; of them the download's), and the forward's device seconds from CUDA events; a
    step's host work was hidden under the device when its download still waited for the step
    (TIMELINE_WAIT_S or longer);
(9) the same shape with Q4_K weights (`Engine.random(dtype="q4_k")`: bf16 activations and KV on
    CUDA, q/k/v and gate/up stacked, candle's MMVQ kernels at batch 1): its own bound (the
    quantized weights' bytes a step reads over the read bandwidth) and its batch-1 ITL against it
    (goal <= 1.3x: printed, not a failure), after the bf16 engine is freed, as time allows;
(5) tokens/s (generated tokens over wall time, prefill included) at batch 1, 8 and 32, plain and
    with k = 4 drafts from the replay proposer at a = 0.7 and 0.9 (fixed k, no adaptive length,
    draft budget off), each request replaying its own recorded plain greedy output at that batch,
    and at batches 8 and 32 with n-gram drafts and with suffix-decoding drafts (each looked up
    together on the device, cuda/ngram.cu and cuda/suffix.cu; identity with plain greedy, its
    drafts counted; a random model drafts only where its output repeats);
    goals: batch 32 / batch 1 >= 12x, the a = 0.9 speedup >= 3x at batch 1. Batches run through
    `Engine.generate` over a list of prompts (continuous batching, max_num_seqs = batch size);
(6) the peer on the same device, shape and call: transformers' LlamaForCausalLM with random bf16
    weights, a static cache and its compiled decode step; ITL at batch 1, tokens/s at 8 and 32 as
    time allows. It runs after specrs' engine is freed, in a child process (this script with
    --peer-only: torch never shares a process with specrs' CUDA libraries, and it is killed if it
    would overrun the budget); a peer that cannot be imported or compiled is reported, not a
    failure.

The replay proposer (gpu_check.SyntheticProposer) replays the target's recorded continuation and
corrupts each token with probability 1 - a, so the per-position acceptance is a by construction.

The exit status is 1 when a check fails: a device that cannot be opened, a part that raises, a
kernel outside its tolerance or unlike its reference, a greedy or seeded identity broken beyond a
near-tie, plain decoding that is not repeatable, or a speculative run that drafted nothing. Goals
missed and the peer's troubles are printed, not failures. Each part checks the time left and
records "skipped: time budget" for what would not fit.

`--device cpu` runs the same code on the CPU at gpu_check's small CPU_TIMING shape in f32: it
checks the script, not CUDA. Progress lines come as it goes; one table comes last; the report
is written to gpu_bench.json in --out ($OUT when set, else ".").
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # the helpers this script shares with the device check (after the path it is on)

PROMPT_LEN = 32
K = 4
ACCEPTANCES = (0.9, 0.7)  # 0.9 first: it carries the speedup goal
BATCH_SIZES = (1, 8, 32)
# The n-gram and suffix-decoding runs of batches of at least 8 (their lookups run together on the
# device: step_together::draft_lookups).
LOOKUPS = {
    f"ngram k={K}": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                     "adaptive_draft_length": False},
    f"suffix k={K}": {"method": "suffix", "num_speculative_tokens": K, "adaptive_draft_length": False},
}
LOOKUP_MIN_BATCH = 8
SEEDED = {"temperature": 0.8, "seed": 7}
# The captured shapes (model/candle/step_shape.rs: BATCH_BUCKETS x ROW_BUCKETS), the prefix each
# sequence's cache holds first, and how far a replay's logits may lie from the eager run's (a
# fraction of the largest |logit|: the same kernels on the same shapes, so bitwise is expected).
GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64)
GRAPH_ROWS = (1, 2, 3, 5, 9, 17)
GRAPH_PREFIX = 4
GRAPH_TOLERANCE = 1e-3
# Graph memory for every shape above (their activation estimates sum to about 4.3 GB at this shape).
GRAPH_MEMORY_MB = 16384
GOALS = {"itl_over_bound_max": 1.6, "batch32_over_batch1_min": 12.0, "speedup_a09_k4_batch1_min": 3.0,
         "q4k_itl_over_bound_max": 1.3}
# The quantized engine of part (9): its GGML type, and the seconds it needs (its weights are drawn
# and quantized on the host's cores, then placed on the device).
QUANTIZED = "q4_k"
QUANTIZED_NEED_S = {"gpu": 120.0, "cpu": 20.0}
# Seconds kept for the peer (model init, compile, warm-up and batch 1) while specrs runs, and the
# least left for it to start at all.
PEER_RESERVE_S = {"gpu": 150.0, "cpu": 30.0}
PEER_MIN_S = {"gpu": 60.0, "cpu": 10.0}
# The Llama-3-8B shape as transformers' LlamaConfig takes it (specrs' "llama3-8b").
LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


class Clock:
    """Seconds since the start against --budget-s."""

    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def fits(self, need_s: float, reserve_s: float = 0.0) -> bool:
        return self.elapsed() + need_s + reserve_s <= self.budget_s


def spec_config(k: int) -> dict:
    return {"method": "custom", "num_speculative_tokens": k, "adaptive_draft_length": False}


def error_dict(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=4)}


def part_bound(specrs, engine, device: str, num_tokens: int, bandwidth: float | None = None) -> dict:
    """(1); `bandwidth`: the device's read bandwidth measured before (None: measured here)."""
    on_gpu = device != "cpu"
    num_bytes, repeats = ((2 << 30), 10) if on_gpu else ((256 << 20), 5)
    if bandwidth is None:
        bandwidth = float(specrs._specrs.read_bandwidth(device, num_bytes, repeats))
    context = PROMPT_LEN + num_tokens // 2
    read_bytes = int(engine.step_read_bytes(context))  # weights but the embedding table, plus the KV cache
    out = {"read_bandwidth_bytes_per_s": bandwidth, "buffer_bytes": num_bytes, "repeats": repeats,
           "context_len": context, "step_read_bytes": read_bytes, "weight_bytes": engine.info()["weight_bytes"],
           "bound_s": read_bytes / bandwidth}
    print(f"(1) read bandwidth {bandwidth / 1e12:.3f} TB/s; a step reads {read_bytes / 1e9:.3f} GB at context "
          f"{context}: bound {out['bound_s'] * 1e3:.3f} ms/token", flush=True)
    return out


def part_kernels(specrs, device: str) -> dict:
    """gpu_check's kernels against their CPU references, and the decoder's kernels (fused ops,
    paged KV write and attention) against theirs; each half that raises is a failure row of its
    own."""
    out = {}
    try:
        out["reference"] = gpu_check.part_b(specrs, device)
    except Exception as e:  # a kernel that fails to compile or launch: a failure row, not a crash
        out["reference"] = error_dict(e)
    try:
        decoder = specrs._specrs.check_decoder_kernels(device)
        out["decoder"] = {name: dict(r) for name, r in decoder.items()}
    except Exception as e:
        out["decoder"] = error_dict(e)
    print(f"(2) decoder kernels on {device}: {out['decoder']}", flush=True)
    return out


def part_identity(specrs, engine, dtype: str, vocab: int, num_tokens: int) -> dict:
    prompt = gpu_check.fixed_ids(PROMPT_LEN, vocab, salt=1)
    greedy = specrs.SamplingParams(max_tokens=num_tokens, temperature=0.0)
    plain = engine.generate(prompt, greedy).token_ids
    proposer = gpu_check.SyntheticProposer(plain, len(prompt), 0.9, vocab, seed=4)
    spec = engine.generate(prompt, greedy, speculative_config=spec_config(K), proposer=proposer)
    g = {"k": K, "a": 0.9, "identical": spec.token_ids == plain,
         "first_difference": gpu_check.first_difference(plain, spec.token_ids),
         "num_drafts": spec.metrics["num_drafts"], "near_tie": False}
    if not g["identical"]:
        g.update(gpu_check.divergence(engine, prompt, plain, spec.token_ids, gpu_check.NEAR_TIE[dtype]))
    g["ok"] = g["num_drafts"] > 0 and (g["identical"] or g["near_tie"])

    seeded = specrs.SamplingParams(max_tokens=num_tokens, **SEEDED)
    first = engine.generate(prompt, seeded)
    again = engine.generate(prompt, seeded)
    repeat = {"identical": again.token_ids == first.token_ids,
              "first_difference": gpu_check.first_difference(first.token_ids, again.token_ids)}
    repeat["ok"] = repeat["identical"]
    # The proposer replays the seeded output itself, so most drafts are accepted and verified.
    proposer = gpu_check.SyntheticProposer(first.token_ids, len(prompt), 0.9, vocab, seed=5)
    spec_seeded = engine.generate(prompt, seeded, speculative_config=spec_config(K), proposer=proposer)
    at = gpu_check.first_difference(first.token_ids, spec_seeded.token_ids)
    s = {"k": K, "a": 0.9, **SEEDED, "identical": at is None, "first_difference": at,
         "num_drafts": spec_seeded.metrics["num_drafts"],
         "near_tie": at is not None and gpu_check.draw_near_tie(first, spec_seeded, at)}
    s["ok"] = s["num_drafts"] > 0 and (s["identical"] or s["near_tie"])
    out = {"greedy": g, "seeded_repeat": repeat, "seeded_speculative": s}
    print(f"(3) identity: {out}", flush=True)
    return out


def timed_batch1(specrs, engine, vocab: int, num_tokens: int) -> dict:
    """One greedy request of num_tokens after a 16-token warm-up (which also captures its steps'
    graphs): gpu_check.timed_run's figures."""
    prompt = gpu_check.fixed_ids(PROMPT_LEN, vocab, salt=2)
    engine.generate(prompt, specrs.SamplingParams(max_tokens=16, temperature=0.0))
    return gpu_check.timed_run(engine, prompt, specrs.SamplingParams(max_tokens=num_tokens, temperature=0.0))


def part_itl(specrs, engine, vocab: int, num_tokens: int) -> dict:
    status = engine.step_graph_status()
    graphs_on = status is not None and status["mode"] == "device"
    eager = None
    if graphs_on:
        # Eagerly first (set_step_graphs drops what was captured), then with graphs as the engine runs.
        engine._inner.set_step_graphs(True, GRAPH_MEMORY_MB << 20)
        eager = timed_batch1(specrs, engine, vocab, num_tokens)
        engine._inner.set_step_graphs(False, GRAPH_MEMORY_MB << 20)
    run = timed_batch1(specrs, engine, vocab, num_tokens)
    out = {"itl_s": run["itl_s"], "tokens_per_s": run["tokens_per_s"], "timed_tokens": run["timed_tokens"],
           "num_tokens": len(run["tokens"]), "mean_context_len": PROMPT_LEN + num_tokens // 2, "graphs": graphs_on,
           "step_graphs": engine.step_graph_status()}
    if eager is not None:
        out["eager_itl_s"] = eager["itl_s"]
        out["eager_same_tokens"] = eager["tokens"] == run["tokens"]
    print(f"(4) batch 1 plain greedy: ITL {out['itl_s'] * 1e3:.3f} ms over {out['timed_tokens']} tokens "
          f"({'graphs' if graphs_on else 'eager'}"
          + (f"; eager {eager['itl_s'] * 1e3:.3f} ms)" if eager else ")"), flush=True)
    return out


def part_graphs(engine, vocab: int, clock: Clock, reserve_s: float) -> dict:
    """(7) every captured shape's replay against its eager run (see the module header)."""
    import numpy as np

    status = engine.step_graph_status()
    if status is None or status["mode"] != "device":
        return {"skipped": f"steps are not captured here (mode {status and status['mode']}: paged KV on CUDA)"}
    out: dict = {"buckets": {}}
    for batch in GRAPH_BATCHES:
        for rows in GRAPH_ROWS:
            name = f"{batch}x{rows}"
            if not clock.fits(5.0, reserve_s):
                out["buckets"][name] = {"skipped": "time budget"}
                continue
            seqs = [{"prefix": gpu_check.fixed_ids(GRAPH_PREFIX, vocab, salt=100 + i),
                     "tokens": gpu_check.fixed_ids(rows, vocab, salt=300 + i), "logits": "all"} for i in range(batch)]
            first = engine.forward_batch(seqs)  # the key's first step: eager
            engine.forward_batch(seqs)  # captured (run eagerly over the graph's own buffer)
            before = engine.step_graph_status()
            third = engine.forward_batch(seqs)  # replayed (so are the prefixes' steps)
            after = engine.step_graph_status()
            eager = np.concatenate([s.logits for s in first])
            replay = np.concatenate([s.logits for s in third])
            diff, scale = float(np.max(np.abs(eager - replay))), float(np.max(np.abs(eager)))
            replays = after["num_replays"] - before["num_replays"]
            out["buckets"][name] = {"max_abs_diff": diff, "tolerance": GRAPH_TOLERANCE * scale,
                                    "bitwise": bool(np.array_equal(eager, replay)), "replays": replays,
                                    "ok": diff <= GRAPH_TOLERANCE * scale and replays == batch + 1}
        done = [b for k, b in out["buckets"].items() if k.startswith(f"{batch}x") and "ok" in b]
        print(f"(7) batch {batch}: {sum(b['ok'] for b in done)}/{len(done)} shapes replay their eager logits "
              f"({sum(b['bitwise'] for b in done)} bitwise)", flush=True)
    status = engine.step_graph_status()
    layers = engine.info()["num_layers"]
    out["status"] = status
    out["nodes_per_layer"] = status["num_graph_nodes"] / max(1, status["num_graphs"]) / layers
    return out


def part_quantized(specrs, shape, device: str, num_tokens: int, layout: dict, bandwidth: float | None) -> dict:
    """(9) the same shape with Q4_K weights (see the module header); `bandwidth`: part (1)'s."""
    t0 = time.perf_counter()
    engine = specrs.Engine.random(shape, seed=gpu_check.SEED, dtype=QUANTIZED, device=device, **layout)
    engine.set_measure_on_demand(False)
    build_s = time.perf_counter() - t0
    vocab = engine.info()["vocab_size"]
    bound = part_bound(specrs, engine, device, num_tokens, bandwidth)
    run = timed_batch1(specrs, engine, vocab, num_tokens)
    out = {"dtype": QUANTIZED, "build_s": build_s, "weight_bytes": engine.info()["weight_bytes"], "bound": bound,
           "itl_s": run["itl_s"], "timed_tokens": run["timed_tokens"], "itl_over_bound": run["itl_s"] / bound["bound_s"],
           "step_graphs": engine.step_graph_status()}
    print(f"(9) {QUANTIZED} batch 1 plain greedy: ITL {out['itl_s'] * 1e3:.3f} ms = {out['itl_over_bound']:.2f}x its "
          f"bound ({bound['step_read_bytes'] / 1e9:.3f} GB a step; built in {build_s:.0f} s)", flush=True)
    return out


TIMELINE_BATCH = 8
TIMELINE_TOKENS = 48
# A download that waited at least this long waited for the device (a few words' copy alone takes
# ~10-20 us over PCIe).
TIMELINE_WAIT_S = 50e-6


def part_timeline(specrs, engine, vocab: int) -> dict:
    """(8) the asynchronous loop's timeline (see the module header)."""
    scheduler = specrs._specrs.Scheduler(engine._inner, max_num_seqs=TIMELINE_BATCH, draft_budget="off")
    params = specrs.SamplingParams(max_tokens=TIMELINE_TOKENS, temperature=0.0)
    for i in range(TIMELINE_BATCH):
        scheduler.add(i, gpu_check.fixed_ids(PROMPT_LEN, vocab, salt=500 + i), params)
    steps, held, text = [], None, [""] * TIMELINE_BATCH
    while scheduler.has_unfinished:
        scheduler.launch()
        if held is not None:  # the host's work on the step before, while the device runs this one
            for output in held:
                text[output["request_id"]] += engine.tokenizer.decode(output["token_ids"])
        outputs, report = scheduler.finish()
        held = outputs
        steps.append({key: report[key] for key in ("num_sequences", "num_rows", "launch_s", "overlapped_host_s",
                                                   "finish_s", "wait_s", "forward_s")})
    # Decode steps of the whole batch (no prompt rows), past the first few (their shapes' captures).
    decode = [st for st in steps if st["num_sequences"] == TIMELINE_BATCH
              and st["num_rows"] == TIMELINE_BATCH][4:]

    def median(key: str) -> float | None:
        values = sorted(st[key] for st in decode)
        return values[len(values) // 2] if values else None

    # The host's work between launch and finish was hidden under the device when the finish's
    # download still waited for the step (longer than a download of a few words alone takes).
    hidden = sum(st["wait_s"] >= TIMELINE_WAIT_S for st in decode)
    out = {"batch": TIMELINE_BATCH, "num_decode_steps": len(decode), "launch_s": median("launch_s"),
           "overlapped_host_s": median("overlapped_host_s"), "finish_s": median("finish_s"),
           "wait_s": median("wait_s"), "forward_s": median("forward_s"), "hidden_steps": hidden, "steps": steps}
    if decode:
        print(f"(8) async loop, batch {TIMELINE_BATCH}: median per decode step: launch {out['launch_s'] * 1e3:.3f} ms, "
              f"host work while in flight {out['overlapped_host_s'] * 1e3:.3f} ms, finish "
              f"{out['finish_s'] * 1e3:.3f} ms (its download {out['wait_s'] * 1e3:.3f} ms), device forward "
              f"{out['forward_s'] * 1e3:.3f} ms; host work hidden under the device in {hidden}/{len(decode)} steps",
              flush=True)
    return out


class ReplayByPrompt:
    """One proposer object for a batch that hands each request to its own replay proposer, found
    by the request's prompt (the first PROMPT_LEN ids of its context)."""

    def __init__(self, proposers: dict[tuple[int, ...], gpu_check.SyntheticProposer]):
        self.proposers = proposers

    def propose(self, context_ids, max_tokens):
        key = tuple(context_ids[:PROMPT_LEN])
        if key not in self.proposers:
            raise KeyError(f"no replay proposer for a context starting {list(key[:4])}...")
        return self.proposers[key].propose(context_ids, max_tokens)


def run_batch(specrs, engine, prompts: list[list[int]], params, **speculation) -> dict:
    """All prompts together through continuous batching (one forward per step for every running
    request); tokens/s is every generated token over the call's wall time, prefill included."""
    start = time.perf_counter()
    results = engine.generate(prompts, params, max_num_seqs=len(prompts), draft_budget="off", progress=False,
                              **speculation)
    wall_s = time.perf_counter() - start
    tokens = [r.token_ids for r in results]
    total = {key: sum(r.metrics.get(key, 0.0) for r in results) for key in ("forward_s", "verify_s")}
    return {"tokens": tokens, "wall_s": wall_s, "num_tokens": sum(map(len, tokens)),
            "tokens_per_s": sum(map(len, tokens)) / wall_s if wall_s > 0 else 0.0,
            "num_drafts": sum(r.metrics.get("num_drafts", 0) for r in results),
            "acceptance_rate": (sum(r.metrics.get("num_accepted_tokens", 0) for r in results)
                                / max(1, sum(r.metrics.get("num_draft_tokens", 0) for r in results))),
            "verify_share": gpu_check.verify_share(total)}


def part_batches(specrs, engine, dtype: str, vocab: int, num_tokens: int, clock: Clock, reserve_s: float,
                 batch1_itl_s: float | None) -> dict:
    greedy = specrs.SamplingParams(max_tokens=num_tokens, temperature=0.0)
    out = {}
    previous = None  # (batch size, wall seconds of its plain run)
    for batch in BATCH_SIZES:
        prompts = [gpu_check.fixed_ids(PROMPT_LEN, vocab, salt=10 + i) for i in range(batch)]
        # A run's cost: the plain run's at the batch before, scaled linearly (too much on a GPU).
        if previous is not None:
            need = previous[1] * batch / previous[0]
        else:
            need = 1.5 * num_tokens * (batch1_itl_s or 0.0)
        row: dict = {"batch": batch}
        out[batch] = row
        if not clock.fits(2 * need, reserve_s):
            row["skipped"] = "time budget"
            print(f"(5) batch {batch}: skipped (time budget)", flush=True)
            continue
        recorded = run_batch(specrs, engine, prompts, greedy, speculative_config=False)  # also the warm-up
        plain = run_batch(specrs, engine, prompts, greedy, speculative_config=False)
        previous = (batch, plain["wall_s"])
        need = plain["wall_s"]  # a speculative run takes at most about as long
        row["plain"] = {key: v for key, v in plain.items() if key != "tokens"}
        row["plain"]["repeatable"] = plain["tokens"] == recorded["tokens"]
        if batch > 1 and 1 in out and "request0_tokens" in out[1]:
            row["plain"]["request0_as_at_batch1"] = recorded["tokens"][0] == out[1]["request0_tokens"]
        row["request0_tokens"] = recorded["tokens"][0]
        print(f"(5) batch {batch} plain: {plain['tokens_per_s']:.1f} tok/s", flush=True)
        for a in ACCEPTANCES:
            name = f"a={a} k={K}"
            if not clock.fits(need, reserve_s):
                row[name] = {"skipped": "time budget"}
                continue
            # Each request replays its own recorded output, with its own corruption draws.
            replays = {}
            for i, (prompt, ref) in enumerate(zip(prompts, recorded["tokens"], strict=True)):
                seed = batch * 1000 + i * 10 + round(a * 10)
                replays[tuple(prompt)] = gpu_check.SyntheticProposer(ref, PROMPT_LEN, a, vocab, seed=seed)
            proposer = ReplayByPrompt(replays)
            run = run_batch(specrs, engine, prompts, greedy, speculative_config=spec_config(K), proposer=proposer)
            row[name] = against_plain(engine, dtype, prompts, recorded, plain, run)
            row[name]["ok"] = run["num_drafts"] > 0 and not row[name]["mismatches"]
            print_run(batch, name, row[name])
        # n-gram and suffix drafts of a batch are looked up together on the device (at least 8
        # requests each, step_together::draft_lookups); a random model drafts only where its output
        # repeats.
        for name, config in LOOKUPS.items():
            if batch < LOOKUP_MIN_BATCH:
                continue
            if not clock.fits(need, reserve_s):
                row[name] = {"skipped": "time budget"}
                continue
            run = run_batch(specrs, engine, prompts, greedy, speculative_config=config)
            row[name] = against_plain(engine, dtype, prompts, recorded, plain, run)
            row[name]["ok"] = not row[name]["mismatches"]
            print_run(batch, name, row[name])
    for row in out.values():
        row.pop("request0_tokens", None)
    return out


def against_plain(engine, dtype: str, prompts, recorded: dict, plain: dict, run: dict) -> dict:
    """A speculative batch run's numbers, its speedup over the plain run, and each request's
    tokens against its recorded plain greedy output (equal, a near-tie, or a mismatch)."""
    r = {key: v for key, v in run.items() if key != "tokens"}
    r["speedup"] = run["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0
    r["num_identical"], r["near_ties"], r["mismatches"] = 0, [], []
    for i, (prompt, ref, got) in enumerate(zip(prompts, recorded["tokens"], run["tokens"], strict=True)):
        if got == ref:
            r["num_identical"] += 1
            continue
        d = gpu_check.divergence(engine, prompt, ref, got, gpu_check.NEAR_TIE[dtype])
        (r["near_ties"] if d["near_tie"] else r["mismatches"]).append({"request": i, **d})
    return r


def print_run(batch: int, name: str, r: dict) -> None:
    print(f"(5) batch {batch} {name}: {r['tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x), {r['num_drafts']} drafts, "
          f"acceptance {r['acceptance_rate']:.2f}, verify share {r['verify_share'] * 100:.2f}%, "
          f"{r['num_identical']}/{len(r['near_ties']) + len(r['mismatches']) + r['num_identical']} = plain, "
          f"{len(r['near_ties'])} near-ties", flush=True)


class TokenClock:
    """A transformers streamer noting when each new token reaches the host (generate copies it with
    .cpu(), which waits for the device). The first put is the prompt."""

    def __init__(self):
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_peer_child(device: str, num_tokens: int, clock: Clock) -> dict:
    """The peer in a child process (this script with --peer-only): torch never shares a process
    with specrs' CUDA libraries, its memory goes back when it exits, and a compile that runs past
    the time left is killed rather than overrunning the call. Rows it finished before a kill are
    kept (the child saves after each)."""
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"not installed: {', '.join(missing)}"}
    timeout_s = clock.budget_s - clock.elapsed() - 10.0
    if timeout_s < PEER_MIN_S["gpu" if device != "cpu" else "cpu"]:
        return {"skipped": "time budget"}
    folder = tempfile.mkdtemp(prefix="gpu_bench_peer_")
    command = [sys.executable, os.path.abspath(__file__), "--peer-only", "--device", device, "--tokens",
               str(num_tokens), "--budget-s", str(timeout_s - 5.0), "--out", folder]
    env = dict(os.environ)
    if gpu_check.REEXEC_MARK in env:  # undo ensure_cuda_libraries: torch loads its own CUDA libraries
        added = set(gpu_check.library_dirs())
        env["LD_LIBRARY_PATH"] = ":".join(p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and p not in added)
    try:
        returncode = subprocess.run(command, timeout=timeout_s, check=False, env=env).returncode
        killed = None
    except subprocess.TimeoutExpired:
        returncode, killed = None, f"the peer was killed after {timeout_s:.0f} s (time budget)"
    path = Path(folder) / "peer.json"
    out = json.loads(path.read_text()) if path.exists() else {
        "error": f"the peer process wrote no report (exit status {returncode})"}
    if killed:
        out["error"] = killed
    return out


def part_peer(device: str, num_tokens: int, clock: Clock, save) -> dict:
    """transformers' Llama on the same device and shape: static cache, compiled decode step.
    `save(out)` is called after each row."""
    try:
        import torch
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as e:  # ImportError, or a broken install
        return {"skipped": f"transformers or torch is not importable: {type(e).__name__}: {e}"}
    on_gpu = device != "cpu"
    shape = LLAMA3_8B if on_gpu else {**gpu_check.CPU_TIMING, "rope_theta": 10000.0, "tie_word_embeddings": False}
    dtype = torch.bfloat16 if on_gpu else torch.float32
    out: dict = {"torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype),
                 "cache_implementation": "static", "rows": {}}

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    model = None
    try:
        t0 = time.perf_counter()
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # parameters are made in bf16: no f32 copy on the device
        try:
            with torch.device(device):
                model = LlamaForCausalLM(LlamaConfig(**shape))
        finally:
            torch.set_default_dtype(previous_dtype)
        model.eval()
        model.generation_config.cache_implementation = "static"
        if not on_gpu:
            out["compile"] = "off (cpu mode: checks the script)"
        elif hasattr(transformers, "CompileConfig"):
            # generate compiles the decode step itself (prefill stays eager) when the cache is static.
            model.generation_config.compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
            out["compile"] = "transformers compile_config(fullgraph=True, mode='reduce-overhead')"
        else:
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            out["compile"] = "torch.compile(model.forward, mode='reduce-overhead', fullgraph=True)"
        sync()
        out["init_s"] = time.perf_counter() - t0
        print(f"(6) peer: transformers {transformers.__version__}, torch {torch.__version__}, built in "
              f"{out['init_s']:.1f} s; {out['compile']}", flush=True)
        save(out)

        def generate(input_ids, streamer=None):
            return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                  max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                                  pad_token_id=0, streamer=streamer)

        first_cost = None
        for batch in BATCH_SIZES:
            if first_cost is not None and not clock.fits(1.3 * first_cost):
                out["rows"][batch] = {"skipped": "time budget"}
                print(f"(6) peer batch {batch}: skipped (time budget)", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                ids = torch.tensor([gpu_check.fixed_ids(PROMPT_LEN, shape["vocab_size"], salt=10 + i)
                                    for i in range(batch)], device=device)
                for _ in range(2):  # compile and capture (a new batch shape compiles again), then warm
                    generate(ids)
                sync()
                warm_s = time.perf_counter() - t0
                stamps = TokenClock() if batch == 1 else None
                start = time.perf_counter()
                output = generate(ids, stamps)
                sync()
                wall_s = time.perf_counter() - start
                new = int(output.shape[1]) - PROMPT_LEN
                row = {"batch": batch, "warmup_s": warm_s, "wall_s": wall_s, "new_tokens_per_request": new,
                       "tokens_per_s": batch * new / wall_s}
                if stamps is not None and len(stamps.times) >= 2:
                    row["itl_s"] = (stamps.times[-1] - stamps.times[0]) / (len(stamps.times) - 1)
                if hasattr(model, "_compiled_call"):
                    row["compiled_call_seen"] = True
            except Exception as e:  # compile or run failure: reported, the other rows still try
                row = error_dict(e)
            out["rows"][batch] = row
            save(out)
            if first_cost is None:
                first_cost = time.perf_counter() - t0
            print(f"(6) peer batch {batch}: {row}", flush=True)
    except Exception as e:
        out.update(error_dict(e))
        print(f"(6) peer: {out['error']}", flush=True)
    finally:
        model = None  # the weights go before the cache is emptied
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    return out


def failures(report: dict) -> list[str]:
    """Everything that decides the exit status, one line each (the peer never does)."""
    out = [f"({part}) raised {report[part]['error']}" for part in ("engine", "bound", "kernels", "identity", "itl",
                                                                    "graphs", "timeline", "batches", "quantized")
           if isinstance(report.get(part), dict) and "error" in report[part]]
    graphs = report.get("graphs", {})
    for name, b in graphs.get("buckets", {}).items():
        if "ok" in b and not b["ok"]:
            out.append(f"(7) shape {name}: " + (f"{b['replays']} steps replayed, not {name.split('x')[0]} + 1"
                       if b["max_abs_diff"] <= b["tolerance"] else
                       f"the replay's logits lie {b['max_abs_diff']:.3g} from the eager run's (> {b['tolerance']:.3g})"))
    error = graphs.get("status", {}).get("capture_error")
    if error:
        out.append(f"(7) a capture failed: {error}")
    kernels = report.get("kernels", {})
    for half in ("reference", "decoder"):
        rows = kernels.get(half, {})
        if "error" in rows:
            out.append(f"(2) {half} kernels raised {rows['error']}")
            continue
        for name, r in rows.items():
            if isinstance(r, dict) and not r.get("ok", True):
                out.append(f"(2) {half} kernel {name}: {kernel_detail(r)}")
    ident = report.get("identity", {})
    g = ident.get("greedy")
    if g and not g["ok"]:
        out.append("(3) greedy identity: " + ("no draft was made" if not g["num_drafts"] else
                   f"speculative diverged from plain greedy at token {g['first_difference']} (not a near-tie: "
                   f"logit gap {gpu_check.fmt_gap(g)})"))
    if ident.get("seeded_repeat") and not ident["seeded_repeat"]["ok"]:
        out.append(f"(3) the seeded request run twice differs at token {ident['seeded_repeat']['first_difference']}")
    s = ident.get("seeded_speculative")
    if s and not s["ok"]:
        out.append("(3) seeded identity: " + ("no draft was made" if not s["num_drafts"] else
                   f"speculative diverged from plain at token {s['first_difference']} (not a draw near-tie)"))
    for batch, row in report.get("batches", {}).items():
        if not isinstance(row, dict) or "plain" not in row:
            continue
        if not row["plain"]["repeatable"]:
            out.append(f"(5) batch {batch}: plain greedy run twice gave other tokens")
        for name in [f"a={a} k={K}" for a in ACCEPTANCES] + list(LOOKUPS):
            r = row.get(name, {})
            if "ok" in r and not r["ok"]:
                out.append(f"(5) batch {batch} {name}: " + ("no draft was made" if not r["mismatches"] else
                           f"{len(r['mismatches'])} requests diverged from plain greedy beyond a near-tie "
                           f"(first: {r['mismatches'][0]})"))
    return out


def kernel_detail(r: dict) -> str:
    if "error" in r:
        return r["error"]
    if "max_abs_diff" in r:
        return f"max abs diff {r['max_abs_diff']:.3g} > tolerance {r['tolerance']:.3g}"
    return json.dumps({k: v for k, v in r.items() if k != "ok"})


def one_line(text, limit: int = 160) -> str:
    """An error's first line, cut to fit a table cell (the JSON has it whole)."""
    first = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return first if len(first) <= limit else first[:limit] + "..."


def not_run(part: dict) -> str:
    """" (FAIL: error)" or " (skipped: why)" for a part that raised or was skipped, else ""."""
    if "error" in part:
        return f" (FAIL: {one_line(part['error'])})"
    return f" (skipped: {part['skipped']})" if "skipped" in part else ""


def fmt(x, spec: str, scale: float = 1.0, missing: str = "-") -> str:
    return missing if x is None else format(x * scale, spec)


def table(report: dict) -> str:
    lines = [(f"gpu_bench on {report['device']} ({report.get('gpu_name') or 'cpu'}): {report['shape']} "
              f"{report['dtype']}, {report.get('kv_layout', 'contiguous')} KV, {report['tokens']} tokens per request, "
              f"{report['elapsed_s']:.0f} s of {report['budget_s']:.0f} s")]
    b, itl = report.get("bound", {}), report.get("itl", {})
    bound_s, itl_s = b.get("bound_s"), itl.get("itl_s")
    ratio = itl_s / bound_s if itl_s and bound_s else None
    lines.append("")
    lines.append("| row | value | goal |")
    lines.append("|---|---|---|")
    if not_run(report.get("engine", {})):
        lines.append(f"| engine |{not_run(report['engine'])} | - |")
    lines.append(f"| bound (context {b.get('context_len', '-')}) | {fmt(b.get('step_read_bytes'), '.3f', 1e-9)} GB / "
                 f"{fmt(b.get('read_bandwidth_bytes_per_s'), '.3f', 1e-12)} TB/s = {fmt(bound_s, '.3f', 1e3)} ms"
                 f"{not_run(b)} | - |")
    missed = "" if ratio is None or ratio <= GOALS["itl_over_bound_max"] else " MISSED"
    lines.append(f"| ITL batch 1 | {fmt(itl_s, '.3f', 1e3)} ms = {fmt(ratio, '.2f')}x the bound{not_run(itl)} | "
                 f"<= {GOALS['itl_over_bound_max']}x{missed} |")
    if itl.get("eager_itl_s"):
        eager_ratio = itl["eager_itl_s"] / bound_s if bound_s else None
        lines.append(f"| ITL batch 1, eager (graphs' gain {itl['eager_itl_s'] / itl_s:.2f}x) | "
                     f"{itl['eager_itl_s'] * 1e3:.3f} ms = {fmt(eager_ratio, '.2f')}x the bound | - |")
    graphs = report.get("graphs", {})
    if graphs:
        done = [b for b in graphs.get("buckets", {}).values() if "ok" in b]
        status = graphs.get("status", {})
        text = (f"{sum(b['ok'] for b in done)}/{len(done)} shapes replay their eager logits "
                f"({sum(b['bitwise'] for b in done)} bitwise); {status.get('num_graphs', 0)} graphs, "
                f"{fmt(graphs.get('nodes_per_layer'), '.1f')} nodes per layer, "
                f"{fmt(status.get('used_bytes'), '.2f', 1e-9)} GB estimated{not_run(graphs)}")
        lines.append(f"| captured steps | {text} | all replay |")
    quantized = report.get("quantized", {})
    if quantized:
        ratio = quantized.get("itl_over_bound")
        missed = "" if ratio is None or ratio <= GOALS["q4k_itl_over_bound_max"] else " MISSED"
        lines.append(f"| {QUANTIZED} ITL batch 1 | {fmt(quantized.get('itl_s'), '.3f', 1e3)} ms = {fmt(ratio, '.2f')}x "
                     f"its bound ({fmt(quantized.get('bound', {}).get('bound_s'), '.3f', 1e3)} ms){not_run(quantized)} | "
                     f"<= {GOALS['q4k_itl_over_bound_max']}x{missed} |")
    timeline = report.get("timeline", {})
    if timeline:
        text = (f"launch {fmt(timeline.get('launch_s'), '.3f', 1e3)} ms, host work in flight "
                f"{fmt(timeline.get('overlapped_host_s'), '.3f', 1e3)} ms, finish {fmt(timeline.get('finish_s'), '.3f', 1e3)} "
                f"ms (download {fmt(timeline.get('wait_s'), '.3f', 1e3)} ms), device forward {fmt(timeline.get('forward_s'), '.3f', 1e3)} ms; hidden in "
                f"{timeline.get('hidden_steps', '-')}/{timeline.get('num_decode_steps', '-')} steps{not_run(timeline)}")
        lines.append(f"| async loop, batch {TIMELINE_BATCH} (median step) | {text} | host work hidden |")
    batches = report.get("batches", {})
    columns = ["plain"] + [f"a={a} k={K}" for a in sorted(ACCEPTANCES)] + list(LOOKUPS)
    if not_run(batches):
        lines.append(f"| batches |{not_run(batches)} | - |")
    for batch in BATCH_SIZES if not not_run(batches) else ():
        row = batches.get(batch, {})
        if "skipped" in row or "plain" not in row:
            lines.append(f"| batch {batch} tok/s | {row.get('skipped', row.get('error', 'not run'))} | - |")
            continue
        cells = []
        for c in columns:
            r = row.get(c, {})
            if c in LOOKUPS and batch < LOOKUP_MIN_BATCH:
                continue
            if "tokens_per_s" not in r:
                cells.append(f"{c} {r.get('skipped', 'not run')}")
                continue
            cell = f"{c} {r['tokens_per_s']:.1f}"
            if c != "plain":
                cell += (f" ({r['speedup']:.2f}x, acc. {r['acceptance_rate']:.2f}, "
                         f"verify {r['verify_share'] * 100:.1f}%, = plain {r['num_identical']}/{batch})")
            cells.append(cell)
        goal = "-"
        if batch == 1:
            speedup = row.get(f"a=0.9 k={K}", {}).get("speedup")
            missed = "" if speedup is None or speedup >= GOALS["speedup_a09_k4_batch1_min"] else " MISSED"
            goal = f">= {GOALS['speedup_a09_k4_batch1_min']}x at a=0.9{missed}"
        lines.append(f"| batch {batch} tok/s | {'; '.join(cells)} | {goal} |")
    for c in columns:
        one, many = batches.get(1, {}).get(c, {}), batches.get(32, {}).get(c, {})
        if one.get("tokens_per_s") and many.get("tokens_per_s"):
            scale = many["tokens_per_s"] / one["tokens_per_s"]
            missed = "" if scale >= GOALS["batch32_over_batch1_min"] else " MISSED"
            lines.append(f"| batch 32 / batch 1, {c} | {scale:.2f}x | >= {GOALS['batch32_over_batch1_min']}x{missed} |")
    peer = report.get("peer", {})
    if "skipped" in peer:
        lines.append(f"| peer | skipped: {peer['skipped']} | - |")
    else:
        if "error" in peer:
            lines.append(f"| peer | {one_line(peer['error'])} | - |")
        for batch, r in peer.get("rows", {}).items():
            if "tokens_per_s" not in r:
                lines.append(f"| peer batch {batch} | {one_line(r.get('skipped') or r.get('error'))} | - |")
                continue
            text = f"{r['tokens_per_s']:.1f} tok/s"
            if "itl_s" in r:
                vs = f", specrs/peer ITL {itl_s / r['itl_s']:.2f}" if itl_s else ""
                over = fmt(r["itl_s"] / bound_s if bound_s else None, ".2f")
                text = f"ITL {r['itl_s'] * 1e3:.3f} ms ({over}x the bound{vs}); {text}"
            compiled = r.get("compiled_call_seen") or peer.get("compile", "").startswith("torch.compile")
            lines.append(f"| peer batch {batch} (transformers {peer.get('transformers')}, static cache, "
                         f"{'compiled' if compiled else 'eager'}) | {text} | - |")
    kernels = report.get("kernels", {})
    for half in ("reference", "decoder"):
        rows = kernels.get(half, {})
        if "error" in rows or "skipped" in rows:
            text = f"FAIL: {one_line(rows['error'])}" if "error" in rows else rows["skipped"]
            lines.append(f"| kernels, {half} | {text} | - |")
            continue
        cells = []
        for name, r in rows.items():
            if isinstance(r, dict) and "ok" in r:
                extra = (f" (max diff {r['max_abs_diff']:.2g}, tolerance {r['tolerance']:.2g})"
                         if "max_abs_diff" in r else "")
                cells.append(f"{name} {'PASS' if r['ok'] else 'FAIL'}{extra}")
        lines.append(f"| kernels, {half} | {', '.join(cells) or 'none'} | - |")
    ident = report.get("identity", {})
    if not_run(ident):
        lines.append(f"| identity |{not_run(ident)} | identical |")
    elif ident:
        def verdict(r: dict) -> str:
            return "identical" if r["identical"] else "near-tie" if r.get("near_tie") else "FAIL"
        g, rep, s = ident["greedy"], ident["seeded_repeat"], ident["seeded_speculative"]
        lines.append(f"| identity | greedy k={K} a=0.9 vs plain: {verdict(g)} ({g['num_drafts']} drafts); seeded T=0.8 "
                     f"twice: {verdict(rep)}; seeded speculative vs plain: {verdict(s)} ({s['num_drafts']} drafts) | "
                     "identical |")
    return "\n".join(lines)


def gpu_name() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20, check=False).stdout.strip() or None
    except Exception:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", help="install this specrs wheel first (into /tmp, not the system)")
    parser.add_argument("--device", default="cuda",
                        help="cuda[:N] (a device that cannot be opened fails), or cpu for the CPU mode")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per timed request")
    parser.add_argument("--budget-s", type=float, default=450.0, help="seconds the whole run may take")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--kv-layout", choices=("paged", "contiguous"), default="paged",
                        help="the engine's KV layout (paged: one pool sized for the largest batch)")
    parser.add_argument("--peer-only", action="store_true",
                        help="run only the peer and write peer.json to --out (how the main run starts it)")
    args = parser.parse_args()
    clock = Clock(args.budget_s)
    device = args.device
    on_gpu = device != "cpu"
    if args.peer_only:
        Path(args.out).mkdir(parents=True, exist_ok=True)

        def save(out: dict) -> None:
            (Path(args.out) / "peer.json").write_text(json.dumps(out, indent=1, default=str))

        save(part_peer(device, args.tokens, clock, save))
        return 0
    if on_gpu:
        gpu_check.ensure_cuda_libraries()
    if args.wheel:
        gpu_check.install_wheel(args.wheel)
    import specrs

    shape, dtype = ("llama3-8b", "bf16") if on_gpu else (gpu_check.CPU_TIMING, "f32")
    report: dict = {"device": device, "gpu_name": gpu_name() if on_gpu else None,
                    "shape": shape if isinstance(shape, str) else "gpu_check.CPU_TIMING", "dtype": dtype,
                    "tokens": args.tokens, "budget_s": args.budget_s, "goals": GOALS, "seed": gpu_check.SEED,
                    "kv_layout": args.kv_layout}
    where = f"{device} ({report['gpu_name']})" if report["gpu_name"] else device
    print(f"gpu_bench on {where}: {report['shape']} {dtype}, {args.kv_layout} KV, {args.tokens} tokens, budget "
          f"{args.budget_s:.0f} s", flush=True)
    if on_gpu:
        try:
            gpu_check.open_device(specrs, device)
        except Exception as e:
            # No silent CPU-against-CPU run: asked for a GPU, a missing one is a failure.
            report["failures"] = [f"cannot open {device}: {type(e).__name__}: {e}"]
            report["elapsed_s"] = clock.elapsed()
            write_report(report, args.out)
            print(f"FAIL: cannot open {device}: {e}\n(--device cpu runs this script's CPU mode)", flush=True)
            return 1

    peer_possible = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    reserve_s = PEER_RESERVE_S["gpu" if on_gpu else "cpu"] if peer_possible else 0.0

    engine = None
    try:
        t0 = time.perf_counter()
        # A paged pool holds every request of the largest batch at once (its drafts included).
        layout = {"kv_layout": "paged", "max_kv_tokens": max(BATCH_SIZES) * (PROMPT_LEN + args.tokens + 4 * K),
                  "cuda_graph_memory_mb": GRAPH_MEMORY_MB} if args.kv_layout == "paged" else {"kv_layout": "contiguous"}
        engine = specrs.Engine.random(shape, seed=gpu_check.SEED, dtype=dtype, device=device, **layout)
        # Fixed k and no draft budget read no cost figure: no background measurement between runs.
        engine.set_measure_on_demand(False)
        info = engine.info()
        report["engine"] = {"build_s": time.perf_counter() - t0, "weight_bytes": info["weight_bytes"],
                            "vocab_size": info["vocab_size"], "device": str(info.get("device")),
                            "kernels": info.get("kernels")}
        print(f"engine built in {report['engine']['build_s']:.1f} s: {info['weight_bytes'] / 1e9:.2f} GB of weights",
              flush=True)
    except Exception as e:
        report["engine"] = error_dict(e)
        print(f"engine: {report['engine']['error']}", flush=True)

    if engine is not None:
        vocab = report["engine"]["vocab_size"]
        parts = (
            ("bound", lambda: part_bound(specrs, engine, device, args.tokens)),
            ("kernels", lambda: part_kernels(specrs, device)),
            ("identity", lambda: part_identity(specrs, engine, dtype, vocab, args.tokens)),
            ("itl", lambda: part_itl(specrs, engine, vocab, args.tokens)),
            ("graphs", lambda: part_graphs(engine, vocab, clock, reserve_s)),
            ("timeline", lambda: part_timeline(specrs, engine, vocab)),
            ("batches", lambda: part_batches(specrs, engine, dtype, vocab, args.tokens, clock, reserve_s,
                                             report.get("itl", {}).get("itl_s"))),
        )
        for name, run in parts:
            if name != "batches" and not clock.fits(10.0, reserve_s):
                report[name] = {"skipped": "time budget"}
                continue
            try:
                report[name] = run()
            except Exception as e:  # recorded, so the other parts still run in this one call
                report[name] = error_dict(e)
                print(f"({name}) raised {report[name]['error']}", flush=True)
        del engine
        gc.collect()  # the engine's device memory goes back before the quantized one and the peer
        if clock.fits(QUANTIZED_NEED_S["gpu" if on_gpu else "cpu"], reserve_s):
            try:
                bandwidth = report.get("bound", {}).get("read_bandwidth_bytes_per_s")
                report["quantized"] = part_quantized(specrs, shape, device, args.tokens, layout, bandwidth)
            except Exception as e:
                report["quantized"] = error_dict(e)
                print(f"(quantized) raised {report['quantized']['error']}", flush=True)
            gc.collect()
        else:
            report["quantized"] = {"skipped": "time budget"}

    report["peer"] = run_peer_child(device, args.tokens, clock)

    report["elapsed_s"] = clock.elapsed()
    report["failures"] = failures(report)
    write_report(report, args.out)
    # The table comes last (a device call returns the tail of the output); the whole report is the JSON.
    print("\n" + table(report))
    for line in report["failures"]:
        print(f"FAIL {line}")
    print(f"gpu_bench {'FAIL' if report['failures'] else 'PASS'} on {device}: {len(report['failures'])} failures "
          f"in {report['elapsed_s']:.0f} s; the report is {Path(args.out) / 'gpu_bench.json'}", flush=True)
    return 1 if report["failures"] else 0


def write_report(report: dict, out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "gpu_bench.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
