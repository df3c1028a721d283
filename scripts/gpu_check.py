#!/usr/bin/env python3
"""The CUDA build's check, sized for one call of a lent GPU machine (a few minutes).

    python3 scripts/gpu_check.py --wheel dist-cuda/specrs-*.whl [--out DIR]

(a) logits on CUDA against the CPU for a random-weight Llama built from one seed, in f32, bf16,
    q8_0 and q4_k, and greedy speculative output against plain greedy output on the device: f32
    and bf16 at k = 2, 4, 8; q8_0 and q4_k at k = 8, whose 9-row verify passes are where candle's
    quantized matmul switches from its per-row kernel to dequantize-and-multiply;
(b) the batched acceptance (chain and tree) and n-gram kernels against their CPU references on
    random inputs;
(c) a Llama-3-8B-shaped bf16 model with random weights: the baseline inter-token latency against
    the HBM bound (the bytes a step reads, weights but the embedding table plus the KV cache, over
    the read bandwidth measured in this run), and decode tokens/s
    with a controlled-acceptance proposer (it replays the target's recorded greedy continuation
    and corrupts each token with probability 1 - a) for a in {0.5, 0.7, 0.9} and k in {2, 4, 8},
    beside the expected-speedup model fed the measured verify-cost curve (forward_cost waits for
    the device, so v(n) is GPU time). A replay is timed only up to its first divergence from the
    recorded sequence: past it, the drafts no longer continue the context. One sampled request
    (temperature 1, verified by the acceptance kernel on the device) is timed with and without
    the proposer.

(d) requests whose logits are processed before sampling (issue 24; verified on the host on CUDA,
    since the acceptance kernel takes softmax(logits / T) only): penalties, logit_bias and
    logprobs, greedy and seeded at temperature 0.8, speculative against plain on the device (same
    tokens, logprobs within LOGPROB_TOLERANCE; a seeded divergence between neighbouring ids is the
    draw's CDF boundary under float noise, a near-tie, see draw_near_tie); and `n`
    samples sharing the prompt's prefill (the KV cache copied on the device) against each
    seeded request alone.
(f) block drafters on the device (issue 44): random DFlash and DSpark drafters in the small model's
    shape (tests/head_writer.py), chains of their whole block, a DFlash tree, and DSpark with its
    confidence head cutting drafts: greedy output equal to plain greedy output on the device (a
    divergence within NEAR_TIE is a near-tie), and the drafts they made.
(e) token trees through the engine on the device (the tree kernel verifies temperature-only
    requests): a proposer replaying the recorded continuation as a binary tree (at each depth the
    right token and a wrong one, the right one first with probability a), greedy and seeded at
    temperature 0.8: the same tokens as plain decoding, trees drafted and walks past rank 0.

The exit status is 1 when anything fails: a device that cannot be opened, logits outside their
tolerance, a kernel that disagrees with its CPU reference or fails to compile or launch, greedy
speculative output that is not plain greedy output, a replayed run that does not match the
baseline, or a check that drafted nothing. A greedy divergence where, teacher-forced on the
device, the two tokens' logits are within NEAR_TIE of the largest logit is reported as a near-tie
(kernels of different shapes round differently; see the README's CUDA section) and does not fail.

`--device cpu` runs the same code on the CPU at a small shape: every comparison is then CPU against
CPU, which checks the script, not CUDA. The table comes last. Writes gpu_check.json to --out
($OUT when set).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

# Libraries a CUDA build of specrs loads (the driver's libcuda.so.1 comes from the driver).
CUDA_LIBRARIES = ["libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10", "libnvrtc.so.13", "libcudart.so.13"]
REEXEC_MARK = "SPECRS_GPU_CHECK_LIBS_SET"

SMALL = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
# Part (c) on the CPU: big enough for the memory bound to matter, small enough for 2 cores.
CPU_TIMING = {**SMALL, "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8}
SEED = 1234
# Logit gap (over the largest |logit|) under which a greedy divergence is a near-tie, per format:
# f32 kernels differ by summation order only; bf16 and quantized ones by where each rounds.
NEAR_TIE = {"f32": 1e-4, "bf16": 1e-2, "q8_0": 1e-2, "q4_k": 1e-2}
# (format, k) pairs of the greedy identity check in (a).
GREEDY_RUNS = [("f32", 2), ("f32", 4), ("f32", 8), ("bf16", 2), ("bf16", 4), ("bf16", 8), ("q8_0", 8), ("q4_k", 8)]
SAMPLED_TEMPERATURE = 1.0


def library_dirs() -> list[str]:
    """Folders holding the CUDA libraries: a system toolkit, or the nvidia-* wheels of any Python
    on the machine (PyTorch's ship them)."""
    roots = ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib", *glob.glob("/usr/local/cuda-13*/lib64")]
    site_dirs = {sysconfig.get_paths()["purelib"], *glob.glob("/opt/*/.venv/lib/python3*/site-packages")}
    for site in site_dirs:
        roots += glob.glob(f"{site}/nvidia/cu13/lib") + glob.glob(f"{site}/nvidia/*/lib")
    found = []
    for lib in CUDA_LIBRARIES:
        for root in roots:
            if os.path.exists(os.path.join(root, lib)):
                if root not in found:
                    found.append(root)
                break
    return found


def open_device(specrs, device: str) -> None:
    """Opens `device` and runs none of our kernels, so a kernel that fails on a present GPU fails its
    own check, not this probe: read_bandwidth opens the device, then refuses a 0-byte buffer with a
    ConfigError. Raises what opening the device raised (a DeviceError where none opens)."""
    try:
        specrs._specrs.read_bandwidth(device, 0, 1)
    except specrs.ConfigError:
        pass


def ensure_cuda_libraries() -> None:
    """The dynamic loader reads LD_LIBRARY_PATH at start-up only, so set it and start again."""
    if os.environ.get(REEXEC_MARK):
        return
    dirs = library_dirs()
    env = dict(os.environ, **{REEXEC_MARK: "1"})
    env["LD_LIBRARY_PATH"] = ":".join(dirs + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p])
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def install_wheel(wheel: str) -> None:
    target = Path("/tmp/specrs-gpu-check-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--upgrade", "--target", str(target), wheel],
        check=True,
    )
    sys.path.insert(0, str(target))


def fixed_ids(n: int, vocab: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + 13 + salt * 104729) % vocab for i in range(n)]


def compare_logits(a, b) -> dict:
    import numpy as np

    scale = float(np.abs(a).max())
    return {
        "max_abs_diff": float(np.abs(a - b).max()),
        "rel_max_diff": float(np.abs(a - b).max()) / scale,
        "top1_agreement": float((a.argmax(axis=1) == b.argmax(axis=1)).mean()),
    }


# format -> (relative logit tolerance, top-1 floor) of (a)'s CPU-vs-device comparison: f32 differs
# by summation order only; bf16 and the quantized formats by where each side rounds (candle's
# CUDA quantized matmul dequantizes for multi-row inputs, the CPU one quantizes the activations
# to 8 bits).
FORMAT_TOLERANCES = {"f32": (1e-3, 0.99), "bf16": (5e-2, 0.9), "q8_0": (5e-2, 0.9), "q4_k": (5e-2, 0.9)}


def part_a(specrs, device: str) -> dict:
    """Logits of one teacher-forced forward, CPU vs device, per weight format; greedy speculative
    vs plain greedy on the device."""
    ids = fixed_ids(96, SMALL["vocab_size"])
    out = {}
    for fmt, (tolerance, floor) in FORMAT_TOLERANCES.items():
        cpu = specrs.Engine.random(SMALL, seed=SEED, dtype=fmt, device="cpu")
        dev = specrs.Engine.random(SMALL, seed=SEED, dtype=fmt, device=device)
        result = compare_logits(cpu.logits(ids), dev.logits(ids))
        result["ok"] = result["rel_max_diff"] <= tolerance and result["top1_agreement"] >= floor
        out[fmt] = result
        print(f"(a) {fmt:5s} {device} vs cpu: {result}", flush=True)

    # Greedy identity under heavy drafting: the synthetic proposer drafts k tokens every step, so
    # most steps verify several tokens in one forward.
    params = specrs.SamplingParams(max_tokens=64, temperature=0.0)
    prompt = fixed_ids(24, SMALL["vocab_size"], salt=1)
    greedy = {}
    engines, plains = {}, {}
    for fmt, k in GREEDY_RUNS:
        if fmt not in engines:
            engines[fmt] = specrs.Engine.random(SMALL, seed=SEED, dtype=fmt, device=device)
            plains[fmt] = engines[fmt].generate(prompt, params).token_ids
        engine, plain = engines[fmt], plains[fmt]
        proposer = SyntheticProposer(plain, len(prompt), 0.8, SMALL["vocab_size"], seed=k)
        config = {"method": "custom", "num_speculative_tokens": k, "adaptive_draft_length": False}
        spec = engine.generate(prompt, params, speculative_config=config, proposer=proposer)
        result = {"identical": spec.token_ids == plain, "first_difference": first_difference(plain, spec.token_ids),
                  "num_drafts": spec.metrics["num_drafts"]}
        if not result["identical"]:
            result.update(divergence(engine, prompt, plain, spec.token_ids, NEAR_TIE[fmt]))
        result["ok"] = result["num_drafts"] > 0 and (result["identical"] or result["near_tie"])
        greedy[f"{fmt} k={k}"] = result
    out["greedy_identity"] = greedy
    print(f"(a) greedy speculative vs plain on {device}: {greedy}", flush=True)
    return out


# Largest |logprob| difference allowed between speculative and plain decoding in (d) (f32 weights:
# the verify pass and the single step differ by summation order only).
LOGPROB_TOLERANCE = 1e-3


def part_d(specrs, device: str) -> dict:
    """Processed requests (penalties, logit_bias, logprobs) and `n` samples on the device."""
    vocab = SMALL["vocab_size"]
    engine = specrs.Engine.random(SMALL, seed=SEED, dtype="f32", device=device)
    prompt = fixed_ids(24, vocab, salt=2)
    processing = dict(max_tokens=48, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                      logit_bias={t: 4.0 for t in fixed_ids(16, vocab, salt=3)}, logprobs=3)
    out = {}
    for name, sampling in (("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=0.8, seed=11))):
        params = specrs.SamplingParams(**processing, **sampling)
        plain = engine.generate(prompt, params)
        proposer = SyntheticProposer(plain.token_ids, len(prompt), 0.8, vocab, seed=3)
        config = {"method": "custom", "num_speculative_tokens": 4, "adaptive_draft_length": False}
        spec = engine.generate(prompt, params, speculative_config=config, proposer=proposer)
        same = spec.token_ids == plain.token_ids
        at = first_difference(plain.token_ids, spec.token_ids)
        gap = logprob_gap(plain.logprobs, spec.logprobs, at)
        tie = not same and sampling["temperature"] > 0 and draw_near_tie(plain, spec, at)
        out[name] = {"identical": same, "first_difference": at, "diverged_at": at, "near_tie": tie,
                     "num_drafts": spec.metrics["num_drafts"], "max_logprob_diff": gap,
                     "ok": (same or tie) and spec.metrics["num_drafts"] > 0 and gap <= LOGPROB_TOLERANCE}
    params = specrs.SamplingParams(max_tokens=32, temperature=0.8, seed=5, n=3)
    samples = [r.token_ids for r in engine.generate_samples(prompt, params, speculative_config=False)]
    alone = [engine.generate(prompt, specrs.SamplingParams(max_tokens=32, temperature=0.8, seed=5 + i)).token_ids
             for i in range(3)]
    out["samples"] = {"num_equal": sum(a == b for a, b in zip(samples, alone)), "n": 3,
                      "ok": samples == alone}
    print(f"(d) processed requests and samples on {device}: {out}", flush=True)
    return out


def part_f(specrs, device: str) -> dict:
    """Random DFlash and DSpark drafters on the small f32 model: greedy identity on the device."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from head_writer import write_dflash, write_dspark

    import tempfile

    shape = dict(hidden=SMALL["hidden_size"], heads=SMALL["num_attention_heads"], kv_heads=SMALL["num_key_value_heads"],
                 head_dim=SMALL["hidden_size"] // SMALL["num_attention_heads"], ffn=SMALL["intermediate_size"],
                 vocab=SMALL["vocab_size"], layers=SMALL["num_hidden_layers"], rope_theta=10000.0)
    engine = specrs.Engine.random(SMALL, seed=SEED, dtype="f32", device=device)
    params = specrs.SamplingParams(max_tokens=48, temperature=0.0)
    prompt = fixed_ids(24, SMALL["vocab_size"], salt=4)
    plain = engine.generate(prompt, params).token_ids
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        dflash = str(write_dflash(Path(tmp) / "dflash", shape, num_layers=2, block_size=8, layer_ids=[0, 2]))
        dspark = str(write_dspark(Path(tmp) / "dspark", shape, block_size=6, layer_ids=[0, 2]))
        runs = {
            "dflash k=7": {"method": "dflash", "model": dflash, "num_speculative_tokens": 7},
            "dflash tree": {"method": "dflash", "model": dflash, "num_speculative_tokens": 8, "tree": True,
                            "tree_depth": 4, "tree_top_k": 2},
            "dspark k=6": {"method": "dspark", "model": dspark, "num_speculative_tokens": 6},
            "dspark k=6, confidence 0.3": {"method": "dspark", "model": dspark, "num_speculative_tokens": 6,
                                           "draft_confidence_threshold": 0.3},
        }
        for name, config in runs.items():
            spec = engine.generate(prompt, params, speculative_config={**config, "adaptive_draft_length": False})
            result = {"identical": spec.token_ids == plain, "first_difference": first_difference(plain, spec.token_ids),
                      "num_drafts": spec.metrics["num_drafts"], "num_draft_tokens": spec.metrics["num_draft_tokens"]}
            if not result["identical"]:
                result.update(divergence(engine, prompt, plain, spec.token_ids, NEAR_TIE["f32"]))
            result["ok"] = result["num_drafts"] > 0 and (result["identical"] or result["near_tie"])
            out[name] = result
    print(f"(f) block drafters on {device}: {out}", flush=True)
    return out


def logprob_gap(plain: list[dict], spec: list[dict], upto: int | None) -> float:
    """Largest |logprob| difference of the tokens both runs emitted, up to their first difference,
    and of the top alternatives they share there (past it their contexts differ)."""
    end = len(plain) if upto is None else upto
    gaps = [abs(a["logprob"] - b["logprob"]) for a, b in zip(plain[:end], spec[:end])]
    if upto is not None and upto < min(len(plain), len(spec)):
        theirs = dict(spec[upto]["top_logprobs"])
        gaps += [abs(lp - theirs[t]) for t, lp in plain[upto]["top_logprobs"] if t in theirs]
    return max(gaps, default=0.0)


def draw_near_tie(plain, spec, at: int | None) -> bool:
    """Whether a seeded divergence is the inverse-CDF draw's boundary (sampler.rs `draw_with`
    walks the vocabulary in id order): the same position's uniform picked neighbouring ids, so it
    lies where the cumulative mass passes from one to the other, and logits that agree to float
    noise (the verify pass and the single step sum in other orders; candle's dense gemm blocks by
    shape) put it on either side. Any other divergence is a failure."""
    if at is None or at >= min(len(plain.token_ids), len(spec.token_ids)):
        return False
    return abs(plain.token_ids[at] - spec.token_ids[at]) == 1


def other_token(token: int, vocab: int, rng: random.Random) -> int:
    """A uniformly random token of the vocabulary other than `token` (a replayed draft's corruption)."""
    return (token + 1 + rng.randrange(vocab - 1)) % vocab


class TreeReplay:
    """A binary token tree around the target's recorded continuation: depth d's two children hang
    under depth d - 1's right token; the right token ranks first with probability `acceptance`,
    else second behind a wrong one (so walks take rank 1 too)."""

    def __init__(self, reference: list[int], prompt_len: int, acceptance: float, vocab: int, seed: int):
        self.reference, self.prompt_len, self.acceptance, self.vocab = reference, prompt_len, acceptance, vocab
        self.rng = random.Random(seed)

    def propose(self, context_ids, max_tokens):
        start = len(context_ids) - self.prompt_len
        tokens, parents, right_node = [], [], -1
        for token in self.reference[start:start + max_tokens // 2]:
            wrong = other_token(token, self.vocab, self.rng)
            first = self.rng.random() < self.acceptance
            tokens += [token, wrong] if first else [wrong, token]
            parents += [right_node, right_node]
            right_node = len(tokens) - (2 if first else 1)
        return tokens, None, parents


def part_e(specrs, device: str) -> dict:
    """Token trees verified on the device against plain decoding, greedy and sampled."""
    vocab = SMALL["vocab_size"]
    engine = specrs.Engine.random(SMALL, seed=SEED, dtype="f32", device=device)
    prompt = fixed_ids(24, vocab, salt=4)
    config = {"method": "custom", "num_speculative_tokens": 8, "tree": True}
    out = {}
    for name, sampling in (("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=0.8, seed=21))):
        params = specrs.SamplingParams(max_tokens=64, **sampling)
        plain = engine.generate(prompt, params).token_ids
        spec = engine.generate(prompt, params, speculative_config=config,
                               proposer=TreeReplay(plain, len(prompt), 0.7, vocab, seed=5))
        m = spec.metrics
        result = {"identical": spec.token_ids == plain, "first_difference": first_difference(plain, spec.token_ids),
                  "num_tree_drafts": m["num_tree_drafts"], "num_accepted_tokens": m["num_accepted_tokens"],
                  "num_drafts": m["num_drafts"]}
        # Walks deeper than the rank-0 chain would go: more tokens accepted than rank 0 alone offered.
        result["ok"] = result["identical"] and m["num_tree_drafts"] > 0 and m["num_accepted_tokens"] > m["num_drafts"]
        out[name] = result
    print(f"(e) token trees on {device}: {out}", flush=True)
    return out


def first_difference(expected: list[int], actual: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None."""
    at = next((i for i, (x, y) in enumerate(zip(expected, actual)) if x != y), None)
    if at is None and len(expected) != len(actual):
        at = min(len(expected), len(actual))
    return at


def divergence(engine, prompt: list[int], reference: list[int], other: list[int], near_tie: float) -> dict:
    """Where `other` leaves `reference`, and whether that is a near-tie: the logits of the
    position, teacher-forced on the device over prompt + reference[:i], give the two tokens
    values within near_tie x the largest |logit|."""
    at = first_difference(reference, other)
    if at is None or at >= len(reference) or at >= len(other):
        return {"diverged_at": at, "logit_gap": None, "near_tie": False}
    row = engine.logits(prompt + reference[:at])[-1]
    gap = abs(float(row[reference[at]]) - float(row[other[at]]))
    scale = float(abs(row).max())
    return {"diverged_at": at, "logit_gap": gap, "relative_gap": gap / scale, "near_tie": gap <= near_tie * scale}


def part_b(specrs, device: str) -> dict:
    """Each kernel against its CPU reference on random inputs (the inputs of tests/test_kernels.py).
    A kernel that fails to compile or launch is a failure of its row, not a skip."""
    import numpy as np

    if device == "cpu":
        return {"skipped": "no CUDA device"}
    kernels = specrs._specrs
    out = {}
    for with_probs in (False, True):
        name = "accept_with_probs" if with_probs else "accept"
        inputs = random_accept_inputs(512, 4, 32000, 3, with_probs)
        cpu = kernels.batch_accept(*inputs[:5], draft_probs=inputs[5])
        try:
            gpu = kernels.batch_accept(*inputs[:5], draft_probs=inputs[5], device=device)
        except specrs.SpecrsError as e:
            out[name] = {"ok": False, "error": str(e)}
            continue
        out[name] = explain_accept_mismatches(inputs, cpu, gpu)
    out["tree_accept"] = compare_tree_accept(kernels, specrs.SpecrsError, device)
    rng = np.random.default_rng(5)
    histories = rng.integers(0, 4, size=(256, 2048), dtype=np.uint32)
    lengths = [int(n) for n in rng.integers(1, 2049, size=256)]
    try:
        same = kernels.batch_ngram(histories, lengths, 2, 5, 8, device=device) == kernels.batch_ngram(histories, lengths, 2, 5, 8)
        out["ngram"] = {"ok": same}
    except specrs.SpecrsError as e:
        out["ngram"] = {"ok": False, "error": str(e)}
    print(f"(b) kernels vs CPU references: {out}", flush=True)
    return out


# A sampled draw on the device sums its floats in another order than the CPU reference, so where
# the uniform lies within rounding of a CDF boundary the two may pick neighbouring tokens (on the
# H200, 7 of 512 chain and 4 of 256 tree sequences at vocabulary 32000). Such a mismatch is
# explained when, in the exact (float64) distribution, the uniform lies within DRAW_TOLERANCE (a
# share of the draw's mass) of both tokens' CDF intervals, or, for an accept test, within
# DRAW_TOLERANCE of p(x) / q(x). Any other mismatch, a greedy one, or mismatches in more than
# MAX_MISMATCH_SHARE of the sampled sequences (an off-by-one would hit most of them) fail.
DRAW_TOLERANCE = 1e-4
MAX_MISMATCH_SHARE = 0.05


def draw_margin(weights, uniform: float, token: int) -> float:
    """How far `uniform` lies from `token`'s interval of the inverse CDF of `weights` (float64,
    unnormalized), as a share of their mass; 0 inside it."""
    import numpy as np

    cdf = np.cumsum(weights)
    mass = float(cdf[-1])
    target = float(uniform) * mass
    low, high = float(cdf[token] - weights[token]), float(cdf[token])
    if low <= target < high:
        return 0.0
    return min(abs(target - low), abs(target - high)) / mass


def target_probs(row, temperature: float):
    """softmax(row / temperature) in float64."""
    import numpy as np

    x = row.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    return p / p.sum()


def mismatch_report(margins: list[float], num_greedy: int, num_sampled: int) -> dict:
    share = len(margins) / max(num_sampled, 1)
    return {"greedy_mismatches": num_greedy, "sampled_mismatches": len(margins), "sampled_sequences": num_sampled,
            "max_margin": max(margins, default=0.0),
            "ok": num_greedy == 0 and share <= MAX_MISMATCH_SHARE and all(m <= DRAW_TOLERANCE for m in margins)}


def explain_accept_mismatches(inputs, cpu, gpu) -> dict:
    """The chain-acceptance kernel's results against the CPU reference's (see DRAW_TOLERANCE): for
    each sampled mismatch, the margin of the accept test or of the recovered/bonus draw where
    they part (batch/accept.rs: uniform i decides draft i, the next one draws the token)."""
    import numpy as np

    logits, drafts, num_draft, temperatures, uniforms, probs = inputs
    margins, num_greedy = [], 0
    for s, temperature in enumerate(temperatures):
        if (cpu[0][s], cpu[1][s]) == (gpu[0][s], gpu[1][s]):
            continue
        if temperature == 0:
            num_greedy += 1
            continue
        accepted, n = int(min(cpu[0][s], gpu[0][s])), num_draft[s]
        if cpu[0][s] != gpu[0][s]:  # they part at draft `accepted`'s accept test: u q(x) < p(x)
            x = int(drafts[s, accepted])
            p_x = target_probs(logits[s, accepted], temperature)[x]
            q_x = 1.0 if probs is None else float(probs[s, accepted, x])
            margins.append(abs(float(uniforms[s, accepted]) * q_x - p_x) / q_x)
            continue
        p = target_probs(logits[s, accepted], temperature)
        if accepted < n:  # recovered: from max(0, p - q), q one-hot on the draft without probabilities
            q = np.zeros_like(p) if probs is None else probs[s, accepted].astype(np.float64)
            if probs is None:
                q[int(drafts[s, accepted])] = 1.0
            residual = np.maximum(p - q, 0.0)
            weights, uniform = (residual if residual.sum() > 0 else p), uniforms[s, accepted + 1]
        else:  # bonus: from p
            weights, uniform = p, uniforms[s, n]
        margins.append(max(draw_margin(weights, uniform, int(cpu[1][s])), draw_margin(weights, uniform, int(gpu[1][s]))))
    num_sampled = sum(t > 0 for t in temperatures)
    return mismatch_report(margins, num_greedy, num_sampled)


def random_accept_inputs(batch: int, k: int, vocab: int, seed: int, with_probs: bool):
    """Acceptance-kernel inputs where drafts are often accepted (tests/test_kernels.py uses them too):
    `(logits [batch, k + 1, vocab], drafts [batch, k], num_draft, temperatures, uniforms, probs)`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    drafts = rng.integers(0, vocab, size=(batch, k), dtype=np.uint32)
    logits = rng.normal(0, 2, size=(batch, k + 1, vocab)).astype(np.float32)
    # Peak most rows on the drafted token so drafts are often accepted.
    peaked = rng.random((batch, k)) < 0.7
    for s, i in zip(*np.nonzero(peaked)):
        logits[s, i, drafts[s, i]] += 6.0
    num_draft = [int(n) for n in rng.integers(0, k + 1, size=batch)]
    temperatures = [float(t) for t in rng.choice([0.0, 0.5, 1.0, 1.3], size=batch)]
    uniforms = rng.random((batch, k + 1), dtype=np.float32)
    probs = None
    if with_probs:
        probs = rng.random((batch, k, vocab)).astype(np.float32)
        probs[np.arange(batch)[:, None], np.arange(k)[None, :], drafts] += 5.0
        probs /= probs.sum(axis=2, keepdims=True)
    return logits, drafts, num_draft, temperatures, uniforms, probs


def random_tree_accept_inputs(batch: int, nodes: int, vocab: int, seed: int):
    """Tree-acceptance inputs where walks often go deep (tests/test_kernels.py uses them too):
    `(logits [batch, nodes + 1, vocab], drafts [batch, nodes], parents [batch, nodes], num_nodes,
    temperatures, uniforms [batch, nodes + 1])`. Node i's parent is node i - 1 or, as often, the
    root (-1) or any earlier node; three rows with children in four peak on one child's token, so
    walks stop at the root, mid-tree and at leaves."""
    import numpy as np

    rng = np.random.default_rng(seed)
    drafts = rng.integers(0, vocab, size=(batch, nodes), dtype=np.uint32)
    parents = (np.floor(rng.random((batch, nodes)) * (np.arange(nodes) + 1)) - 1).astype(np.int32)
    chain_links = rng.random((batch, nodes)) < 0.5  # half the nodes continue the previous one: deeper trees
    parents[chain_links] = np.broadcast_to(np.arange(nodes, dtype=np.int32) - 1, (batch, nodes))[chain_links]
    num_nodes = rng.integers(0, nodes + 1, size=batch).astype(np.uint32)
    parents[np.arange(nodes)[None, :] >= num_nodes[:, None]] = -1  # padding
    logits = rng.standard_normal((batch, nodes + 1, vocab), dtype=np.float32) * 2.0
    for s in range(batch):
        for row in range(int(num_nodes[s]) + 1):
            children = np.nonzero(parents[s, : num_nodes[s]] == row - 1)[0]
            if len(children) and rng.random() < 0.75:
                logits[s, row, drafts[s, rng.choice(children)]] += 16.0
    temperatures = rng.choice([0.0, 0.5, 1.0, 1.3], size=batch).astype(np.float32)
    uniforms = rng.random((batch, nodes + 1), dtype=np.float32)
    return logits, drafts, parents, num_nodes, temperatures, uniforms


def compare_tree_accept(kernels, error_type, device: str) -> dict:
    """The tree-acceptance kernel against its CPU reference: batch 256, 16 nodes, vocab 32000.
    Greedy sequences must agree exactly; a sampled mismatch must be explained (DRAW_TOLERANCE)."""
    inputs = random_tree_accept_inputs(256, 16, 32000, seed=4)
    cpu = kernels.batch_tree_accept(*inputs)
    try:
        gpu = kernels.batch_tree_accept(*inputs, device=device)
    except error_type as e:
        return {"ok": False, "error": str(e)}
    return explain_tree_mismatches(inputs, cpu, gpu)


def explain_tree_mismatches(inputs, cpu, gpu) -> dict:
    """For each sampled sequence whose walk differs, the margin of the draw at the first depth
    where the two walks part (batch/tree_accept.rs: depth d draws from its node's row with
    uniform d; the token picks the child, or is the next token)."""
    logits, drafts, parents, num_nodes, temperatures, uniforms = inputs
    margins, num_greedy = [], 0
    for s, temperature in enumerate(temperatures):
        cpu_path, gpu_path = list(cpu[1][s, : cpu[0][s]]), list(gpu[1][s, : gpu[0][s]])
        if cpu_path == gpu_path and cpu[2][s] == gpu[2][s]:
            continue
        if temperature == 0:
            num_greedy += 1
            continue
        depth = next((d for d, (a, b) in enumerate(zip(cpu_path, gpu_path)) if a != b), min(len(cpu_path), len(gpu_path)))
        row = int(cpu_path[depth - 1]) + 1 if depth else 0
        tokens = [int(drafts[s, path[depth]]) if depth < len(path) else int(ends[2][s])
                  for path, ends in ((cpu_path, cpu), (gpu_path, gpu))]
        if tokens[0] == tokens[1]:  # same token, another child or ending: not a rounding difference
            margins.append(float("inf"))
            continue
        p = target_probs(logits[s, row], float(temperature))
        margins.append(max(draw_margin(p, uniforms[s, depth], t) for t in tokens))
    num_sampled = int((temperatures > 0).sum())
    report = mismatch_report(margins, num_greedy, num_sampled)
    report["mean_accepted"] = float(cpu[0].mean())
    return report


class SyntheticProposer:
    """vLLM's `synthetic` idea: replay the target's own greedy continuation, corrupting each token
    with probability 1 - a, so the per-position acceptance is a by construction."""

    def __init__(self, reference: list[int], prompt_len: int, acceptance: float, vocab: int, seed: int):
        self.reference, self.prompt_len, self.acceptance, self.vocab = reference, prompt_len, acceptance, vocab
        self.rng = random.Random(seed)

    def propose(self, context_ids, max_tokens):
        start = len(context_ids) - self.prompt_len
        draft = []
        for token in self.reference[start:start + max_tokens]:
            if self.rng.random() >= self.acceptance:
                token = other_token(token, self.vocab, self.rng)
            draft.append(token)
        return draft


def timed_run(engine, prompt: list[int], params, reference: list[int] | None = None, **speculation) -> dict:
    """One request stepped from here, timed from its first token to its last (TTFT excluded) or,
    given the `reference` a proposer replays, to the last step before the output first departs
    from it: past that point the replayed drafts no longer continue the context, so the rate
    would measure the corruption, not the acceptance. The device is synchronized inside every
    step, so the clock reads device time."""
    stream = engine.stream(prompt, params, **speculation)
    tokens: list[int] = []
    first = last = None  # (time, tokens so far)
    diverged_at = None
    while True:
        step = stream.step()
        now = time.perf_counter()
        if step is None:
            break
        tokens.extend(step[1])
        if reference is not None:
            diverged_at = first_difference(reference[:len(tokens)], tokens)
            if diverged_at is not None:
                stream.cancel()
                break
        if first is None:
            first = (now, len(tokens))
        last = (now, len(tokens))
    result = stream.result
    decode_tokens = last[1] - first[1] if last else 0
    decode_s = last[0] - first[0] if last else 0.0
    return {"tokens": tokens, "diverged_at": diverged_at, "timed_tokens": decode_tokens, "decode_s": decode_s,
            "tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "itl_s": decode_s / decode_tokens if decode_tokens else 0.0, "metrics": result.metrics}


def verify_share(m: dict) -> float:
    """After the forward's sync: the acceptance kernel, its copies and the bookkeeping."""
    return m["verify_s"] / (m["forward_s"] + m["verify_s"]) if m["forward_s"] + m["verify_s"] else 0.0


def part_c(specrs, device: str, num_tokens: int) -> dict:
    on_gpu = device != "cpu"
    config_name, dtype = ("llama3-8b", "bf16") if on_gpu else (CPU_TIMING, "f32")
    t0 = time.perf_counter()
    engine = specrs.Engine.random(config_name, seed=SEED, dtype=dtype, device=device)
    info = engine.info()
    build_s = time.perf_counter() - t0
    bandwidth = specrs._specrs.read_bandwidth(device, (2 << 30) if on_gpu else (256 << 20), 10)
    vocab = info["vocab_size"]
    prompt = fixed_ids(32, vocab, salt=2)
    # A step reads its weights (not the embedding table) and its KV cache once, at the run's mean
    # context; reads stream at the read rate (a read-only reduction, best of 10).
    step_bytes = engine.step_read_bytes(len(prompt) + num_tokens // 2)
    bound_s = step_bytes / bandwidth
    print(f"(c) {config_name if isinstance(config_name, str) else 'small'} {dtype}: {info['weight_bytes'] / 1e9:.2f} GB of "
          f"weights built in {build_s:.1f} s; a step reads {step_bytes / 1e9:.2f} GB; read bandwidth "
          f"{bandwidth / 1e12:.3f} TB/s; HBM bound {bound_s * 1e3:.3f} ms/token", flush=True)

    params = specrs.SamplingParams(max_tokens=num_tokens, temperature=0.0)
    engine.generate(prompt, specrs.SamplingParams(max_tokens=16, temperature=0.0))  # warm-up
    baseline = timed_run(engine, prompt, params)
    reference = baseline["tokens"]
    base_tps, base_itl = baseline["tokens_per_s"], baseline["itl_s"]
    ratios = engine.verify_cost_ratios(9, 512)
    print(f"(c) baseline: ITL {base_itl * 1e3:.3f} ms ({base_itl / bound_s:.2f}x the bound), {base_tps:.1f} tok/s; "
          f"verify cost v(n) = t(n)/t(1) for n = 1..9: {[round(r, 3) for r in ratios]}", flush=True)

    rows = []
    for a in (0.5, 0.7, 0.9):
        for k in (2, 4, 8):
            proposer = SyntheticProposer(reference, len(prompt), a, vocab, seed=int(a * 100) + k)
            config = {"method": "custom", "num_speculative_tokens": k, "adaptive_draft_length": False}
            run = timed_run(engine, prompt, params, reference, speculative_config=config, proposer=proposer)
            m = run["metrics"]
            row = {
                "a": a, "k": k, "tokens_per_s": run["tokens_per_s"], "speedup": run["tokens_per_s"] / base_tps,
                "timed_tokens": run["timed_tokens"],
                "expected_speedup": specrs.expected_speedup(a, k, 0.0, ratios),
                # Should be about a: the first position's acceptance is not conditioned on others.
                "acceptance_first_position": m["acceptance_rate_per_pos"][0] if m["num_drafts"] else 0.0,
                "mean_acceptance_length": m["mean_acceptance_length"],
                "expected_acceptance_length": (1 - a ** (k + 1)) / (1 - a),
                "verify_share": verify_share(m),
                "num_drafts": m["num_drafts"],
                "matches_baseline": run["diverged_at"] is None and run["tokens"] == reference,
            }
            if run["diverged_at"] is not None:
                row.update(divergence(engine, prompt, reference, run["tokens"], NEAR_TIE[dtype]))
            row["ok"] = row["num_drafts"] > 0 and (row["matches_baseline"] or row.get("near_tie", False))
            rows.append(row)
            print(f"(c) a={a} k={k}: {row}", flush=True)

    # Sampled: the proposer still replays the greedy sequence, so acceptance is whatever the target
    # gives those tokens at this temperature; this times the sampled verification path (on a GPU,
    # the acceptance kernel where the logits are), not a speedup.
    sampled_params = specrs.SamplingParams(max_tokens=num_tokens, temperature=SAMPLED_TEMPERATURE, seed=0)
    sampled_base = timed_run(engine, prompt, sampled_params)
    proposer = SyntheticProposer(reference, len(prompt), 0.9, vocab, seed=4)
    config = {"method": "custom", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    sampled_spec = timed_run(engine, prompt, sampled_params, speculative_config=config, proposer=proposer)
    m = sampled_spec["metrics"]
    sampled = {
        "temperature": SAMPLED_TEMPERATURE, "a": 0.9, "k": 4,
        "baseline_tokens_per_s": sampled_base["tokens_per_s"], "tokens_per_s": sampled_spec["tokens_per_s"],
        "speedup": sampled_spec["tokens_per_s"] / sampled_base["tokens_per_s"] if sampled_base["tokens_per_s"] else 0.0,
        "num_drafts": m["num_drafts"], "acceptance_rate": m["acceptance_rate"], "verify_share": verify_share(m),
        "num_tokens": len(sampled_spec["tokens"]),
        "ok": m["num_drafts"] > 0 and len(sampled_spec["tokens"]) == num_tokens,
    }
    print(f"(c) sampled, temperature {SAMPLED_TEMPERATURE:g}: {sampled}", flush=True)
    baseline_again = timed_run(engine, prompt, params)
    return {
        "shape": config_name, "dtype": dtype, "weight_bytes": info["weight_bytes"], "build_s": build_s,
        "read_bandwidth_bytes_per_s": bandwidth, "step_read_bytes": step_bytes, "hbm_bound_s": bound_s,
        "baseline_itl_s": base_itl, "baseline_tokens_per_s": base_tps,
        "baseline_again_tokens_per_s": baseline_again["tokens_per_s"],
        "baseline_again_matches": baseline_again["tokens"] == reference,
        "verify_cost_ratios": ratios, "rows": rows, "sampled": sampled,
    }


def failures(report: dict) -> list[str]:
    """Everything that decides the exit status, one line each."""
    out = [f"({part}) raised {report[part]['error']}" for part in "abcdef" if "error" in report.get(part, {})]
    for fmt, r in report.get("a", {}).items():
        if fmt in FORMAT_TOLERANCES and not r["ok"]:
            out.append(f"(a) {fmt} logits {report['device']} vs cpu: relative max difference {r['rel_max_diff']:.3g} "
                       f"(tolerance {FORMAT_TOLERANCES[fmt][0]:g}), top-1 agreement {r['top1_agreement']:.3f} "
                       f"(floor {FORMAT_TOLERANCES[fmt][1]:g})")
    for name, g in report.get("a", {}).get("greedy_identity", {}).items():
        if not g["ok"]:
            out.append(f"(a) greedy identity {name}: " + ("no draft was made" if not g["num_drafts"] else
                       f"diverged from plain greedy at token {g['diverged_at']} (logit gap {fmt_gap(g)})"))
    for name, r in report.get("b", {}).items():
        if isinstance(r, dict) and not r.get("ok", True):
            out.append(f"(b) {name} kernel: " + (r["error"] if "error" in r else
                       f"{r['greedy_mismatches']} greedy and {r['sampled_mismatches']} of {r['sampled_sequences']} "
                       "sampled sequences differ from the CPU reference" + (
                           f" (the sampled ones up to {r['max_margin']:.3g} of the mass from a CDF boundary; tolerance "
                           f"{DRAW_TOLERANCE:g}, at most {MAX_MISMATCH_SHARE:.0%} of them)" if r["sampled_mismatches"] else "")
                       if "sampled_mismatches" in r else "drafts differ from the CPU reference"))
    c = report.get("c", {})
    for r in c.get("rows", []):
        if not r["ok"]:
            out.append(f"(c) a={r['a']} k={r['k']}: " + ("no draft was made" if not r["num_drafts"] else
                       f"does not match the baseline (diverged at token {r.get('diverged_at')}, logit gap {fmt_gap(r)})"))
    if "sampled" in c and not c["sampled"]["ok"]:
        out.append(f"(c) sampled run: {c['sampled']['num_tokens']} tokens, {c['sampled']['num_drafts']} drafts")
    if "baseline_again_matches" in c and not c["baseline_again_matches"]:
        out.append("(c) the baseline repeated at the end gave other greedy tokens")
    d = report.get("d", {})
    for name in ("greedy", "sampled"):
        if name in d and not d[name]["ok"]:
            r = d[name]
            out.append(f"(d) {name} with penalties, logit_bias and logprobs: " + (
                "no draft was made" if not r["num_drafts"] else
                f"speculative diverged from plain at token {r['first_difference']}"
                if not r["identical"] and not r["near_tie"] else
                f"logprobs differ by {r['max_logprob_diff']:.3g} (tolerance {LOGPROB_TOLERANCE:g})"))
    if "samples" in d and not d["samples"]["ok"]:
        out.append(f"(d) n = 3 samples: {d['samples']['num_equal']} of 3 equal their seeded request alone")
    for name, r in report.get("e", {}).items():
        if isinstance(r, dict) and not r.get("ok", True):
            out.append(f"(e) {name} token trees: " + (
                f"diverged from plain at token {r['first_difference']}" if not r["identical"] else
                f"{r['num_tree_drafts']} trees drafted, {r['num_accepted_tokens']} tokens accepted in "
                f"{r['num_drafts']} drafts"))
    for name, r in report.get("f", {}).items():
        if isinstance(r, dict) and not r.get("ok", True):
            out.append(f"(f) {name}: " + ("no draft was made" if not r["num_drafts"] else
                       f"diverged from plain greedy at token {r['first_difference']} (logit gap {fmt_gap(r)})"))
    return out


def near_ties(report: dict) -> list[str]:
    rows = [(f"(a) {n}", g) for n, g in report.get("a", {}).get("greedy_identity", {}).items()]
    rows += [(f"(f) {n}", r) for n, r in report.get("f", {}).items() if isinstance(r, dict)]
    rows += [(f"(c) a={r['a']} k={r['k']}", r) for r in report.get("c", {}).get("rows", [])]
    ties = [f"{name}: near-tie at token {r['diverged_at']} (logit gap {fmt_gap(r)})" for name, r in rows
            if r.get("near_tie")]
    sampled = report.get("d", {}).get("sampled", {})
    if sampled.get("near_tie"):
        ties.append(f"(d) sampled: the seeded draw at token {sampled['diverged_at']} fell on the boundary between "
                    f"neighbouring ids (logprobs up to it within {sampled['max_logprob_diff']:.2g})")
    return ties


def fmt_gap(r: dict) -> str:
    if r.get("logit_gap") is None:
        return "n/a: a length difference"
    return f"{r['logit_gap']:.3g} = {r['relative_gap']:.2g} of the largest logit"


def table(report: dict) -> str:
    lines = []
    c = report.get("c")
    if c and "rows" in c:
        lines += [
            f"device {report['device']}: baseline ITL {c['baseline_itl_s'] * 1e3:.3f} ms vs HBM bound "
            f"{c['hbm_bound_s'] * 1e3:.3f} ms = {c['baseline_itl_s'] / c['hbm_bound_s']:.2f}x (goal <= 1.3x); "
            f"baseline {c['baseline_tokens_per_s']:.1f} tok/s (again at the end: {c['baseline_again_tokens_per_s']:.1f})",
            "",
            "| a | k | tok/s | speedup | expected | timed tokens | acc. pos 1 | acc. len | expected | verify share | = baseline |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in c["rows"]:
            same = "yes" if r["matches_baseline"] else "near-tie" if r.get("near_tie") else "NO"
            lines.append(
                f"| {r['a']} | {r['k']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['expected_speedup']:.2f}x | "
                f"{r['timed_tokens']} | {r['acceptance_first_position']:.2f} | {r['mean_acceptance_length']:.2f} | "
                f"{r['expected_acceptance_length']:.2f} | {r['verify_share'] * 100:.2f}% | {same} |"
            )
        s = c["sampled"]
        lines.append(f"| T={s['temperature']:g}, replay a={s['a']} | {s['k']} | {s['tokens_per_s']:.1f} | "
                     f"{s['speedup']:.2f}x | - | - | acceptance {s['acceptance_rate']:.2f} | - | - | "
                     f"{s['verify_share'] * 100:.2f}% | (sampled; baseline {s['baseline_tokens_per_s']:.1f} tok/s) |")
        goal = next(r for r in c["rows"] if r["a"] == 0.9 and r["k"] == 4)
        lines.append("")
        lines.append(f"goals: ITL/bound {c['baseline_itl_s'] / c['hbm_bound_s']:.2f} (<= 1.3); a=0.9 k=4 speedup "
                     f"{goal['speedup']:.2f}x (>= 3x); verify share {goal['verify_share'] * 100:.2f}% (< 2%)")
    a, b = report.get("a", {}), report.get("b", {})
    checks = [("a", fmt, r["ok"]) for fmt, r in a.items() if fmt in FORMAT_TOLERANCES]
    checks += [("b", name, r["ok"]) for name, r in b.items() if isinstance(r, dict) and "ok" in r]
    checks += [(part, name, r["ok"]) for part in "de" for name, r in report.get(part, {}).items()
               if isinstance(r, dict) and "ok" in r]
    greedy = a.get("greedy_identity", {})
    identical = sum(g["identical"] for g in greedy.values())
    lines.append("checks: " + ", ".join(f"({p}) {n} {'PASS' if ok else 'FAIL'}" for p, n, ok in checks)
                 + f"; greedy identity {identical}/{len(greedy)}"
                 + (f"; replays matching the baseline {sum(r['matches_baseline'] for r in c['rows'])}/{len(c['rows'])}"
                    if c and "rows" in c else ""))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", help="install this specrs wheel first (into /tmp, not the system)")
    parser.add_argument("--device", default="cuda",
                        help="cuda[:N] (a device that cannot be opened fails the check), or cpu for the CPU mode")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per timed request in (c)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device = args.device
    if device != "cpu":
        ensure_cuda_libraries()
    if args.wheel:
        install_wheel(args.wheel)
    import specrs

    report = {"device": device, "cuda_library_dirs": os.environ.get("LD_LIBRARY_PATH", "")}
    if device != "cpu":
        try:
            open_device(specrs, device)
        except specrs.SpecrsError as e:
            # No silent CPU-against-CPU run: asked for a GPU, a missing one is a failure.
            report["failures"] = [f"cannot open {device}: {e}"]
            write_report(report, args.out)
            print(f"FAIL: cannot open {device}: {e}\n(--device cpu runs this script's CPU mode, which checks the "
                  "script, not CUDA)", flush=True)
            return 1
    # (c), the longest, runs last.
    for part, run in (("a", lambda: part_a(specrs, device)), ("b", lambda: part_b(specrs, device)),
                      ("d", lambda: part_d(specrs, device)), ("e", lambda: part_e(specrs, device)),
                      ("f", lambda: part_f(specrs, device)),
                      ("c", lambda: part_c(specrs, device, args.tokens))):
        try:
            report[part] = run()
        except specrs.SpecrsError as e:  # recorded, so the other parts still run in this one call
            report[part] = {"error": f"{type(e).__name__}: {e}"}
            print(f"({part}) raised {type(e).__name__}: {e}", flush=True)
    report["failures"] = failures(report)
    report["near_ties"] = near_ties(report)
    write_report(report, args.out)
    print("\n" + table(report))
    for line in report["near_ties"]:
        print(f"near-tie (not a failure): {line}")
    for line in report["failures"]:
        print(f"FAIL {line}")
    print(f"gpu_check {'FAIL' if report['failures'] else 'PASS'} on {device}: {len(report['failures'])} failures, "
          f"{len(report['near_ties'])} near-ties")
    return 1 if report["failures"] else 0


def write_report(report: dict, out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
