#!/usr/bin/env python3
"""The CUDA build's check, sized for one call of a lent GPU machine (a few minutes).

    python3 scripts/gpu_check.py --wheel dist-cuda/specrs-*.whl [--out DIR]

(a) logits on CUDA against the CPU for a random-weight Llama built from one seed, in f32, bf16,
    q8_0 and q4_k, and greedy speculative output against plain greedy output on the device;
(b) the batched acceptance and n-gram kernels against their CPU references on random inputs;
(c) a Llama-3-8B-shaped bf16 model with random weights: the baseline inter-token latency against
    the HBM bound (weight bytes over the copy bandwidth measured in this run), and decode tokens/s
    with a controlled-acceptance proposer (it replays the target's recorded greedy continuation
    and corrupts each token with probability 1 - a) for a in {0.5, 0.7, 0.9} and k in {2, 4, 8},
    beside the expected-speedup model fed the measured verify-cost curve.

Without a GPU (or with --device cpu) it runs the same code on the CPU at a small shape: every
comparison is then CPU against CPU, which checks the script, not CUDA. The table comes last.
Writes gpu_check.json to --out ($OUT when set).
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


def part_a(specrs, device: str) -> dict:
    """Logits of one teacher-forced forward, CPU vs device, per weight format; greedy speculative
    vs plain greedy on the device."""
    # (format, rel tolerance, top-1 floor): f32 differs by summation order only; bf16 and the
    # quantized formats by where each side rounds (candle's CUDA quantized matmul dequantizes
    # for multi-row inputs, the CPU one quantizes the activations to 8 bits).
    formats = [("f32", 1e-3, 0.99), ("bf16", 5e-2, 0.9), ("q8_0", 5e-2, 0.9), ("q4_k", 5e-2, 0.9)]
    ids = fixed_ids(96, SMALL["vocab_size"])
    out = {}
    for fmt, tolerance, floor in formats:
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
    for fmt in ("f32", "bf16"):
        engine = specrs.Engine.random(SMALL, seed=SEED, dtype=fmt, device=device)
        plain = engine.generate(prompt, params).token_ids
        for k in (2, 4, 8):
            proposer = SyntheticProposer(plain, len(prompt), 0.8, SMALL["vocab_size"], seed=k)
            config = {"method": "custom", "num_speculative_tokens": k, "adaptive_draft_length": False}
            spec = engine.generate(prompt, params, speculative_config=config, proposer=proposer)
            same = next((i for i, (x, y) in enumerate(zip(plain, spec.token_ids)) if x != y), len(plain))
            greedy[f"{fmt} k={k}"] = {"identical": spec.token_ids == plain, "first_difference": same,
                                      "num_drafts": spec.metrics["num_drafts"]}
    out["greedy_identity"] = greedy
    print(f"(a) greedy speculative vs plain on {device}: {greedy}", flush=True)
    return out


def part_b(specrs, device: str) -> dict:
    """Each kernel against its CPU reference on random inputs (the inputs of tests/test_kernels.py)."""
    import numpy as np

    if device == "cpu":
        return {"skipped": "no CUDA device"}
    kernels = specrs._specrs
    out = {}
    for with_probs in (False, True):
        logits, drafts, num_draft, temperatures, uniforms, probs = random_accept_inputs(512, 4, 32000, 3, with_probs)
        args = (logits, drafts, num_draft, temperatures, uniforms)
        cpu = kernels.batch_accept(*args, draft_probs=probs)
        gpu = kernels.batch_accept(*args, draft_probs=probs, device=device)
        neighbours = sum(a != b for a, b in zip(gpu[1], cpu[1]))
        name = "accept_with_probs" if with_probs else "accept"
        out[name] = {"counts_equal": gpu[0] == cpu[0], "next_token_mismatches": neighbours,
                     "ok": gpu[0] == cpu[0] and neighbours <= 2}
    rng = np.random.default_rng(5)
    histories = rng.integers(0, 4, size=(256, 2048), dtype=np.uint32)
    lengths = [int(n) for n in rng.integers(1, 2049, size=256)]
    same = kernels.batch_ngram(histories, lengths, 2, 5, 8, device=device) == kernels.batch_ngram(histories, lengths, 2, 5, 8)
    out["ngram"] = {"ok": same}
    print(f"(b) kernels vs CPU references: {out}", flush=True)
    return out


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
                token = (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab  # never the right one
            draft.append(token)
        return draft


def decode_rate(result) -> tuple[float, float]:
    """(tokens/s after the first token, mean inter-token latency in s)."""
    m = result.metrics
    n = len(result.token_ids)
    decode_s = m["e2e_s"] - m["ttft_s"]
    return (n - 1) / decode_s, decode_s / (n - 1)


def part_c(specrs, device: str, num_tokens: int) -> dict:
    on_gpu = device != "cpu"
    config, dtype = ("llama3-8b", "bf16") if on_gpu else (CPU_TIMING, "f32")
    t0 = time.perf_counter()
    engine = specrs.Engine.random(config, seed=SEED, dtype=dtype, device=device)
    info = engine.info()
    build_s = time.perf_counter() - t0
    bandwidth = specrs._specrs.copy_bandwidth(device, (2 << 30) if on_gpu else (256 << 20), 10)
    # A token reads every weight once; a read streams at about the copy rate (read + write).
    bound_s = info["weight_bytes"] / bandwidth
    print(f"(c) {config if isinstance(config, str) else 'small'} {dtype}: {info['weight_bytes'] / 1e9:.2f} GB of "
          f"weights built in {build_s:.1f} s; copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write); "
          f"HBM bound {bound_s * 1e3:.3f} ms/token", flush=True)

    vocab = info["vocab_size"]
    prompt = fixed_ids(32, vocab, salt=2)
    params = specrs.SamplingParams(max_tokens=num_tokens, temperature=0.0)
    engine.generate(prompt, specrs.SamplingParams(max_tokens=16, temperature=0.0))  # warm-up
    baseline = engine.generate(prompt, params)
    reference = baseline.token_ids
    base_tps, base_itl = decode_rate(baseline)
    ratios = engine.verify_cost_ratios(9, 512)
    print(f"(c) baseline: ITL {base_itl * 1e3:.3f} ms ({base_itl / bound_s:.2f}x the bound), {base_tps:.1f} tok/s; "
          f"verify cost v(n) = t(n)/t(1) for n = 1..9: {[round(r, 3) for r in ratios]}", flush=True)

    rows = []
    for a in (0.5, 0.7, 0.9):
        for k in (2, 4, 8):
            proposer = SyntheticProposer(reference, len(prompt), a, vocab, seed=int(a * 100) + k)
            config = {"method": "custom", "num_speculative_tokens": k, "adaptive_draft_length": False}
            result = engine.generate(prompt, params, speculative_config=config, proposer=proposer)
            tps, _ = decode_rate(result)
            m = result.metrics
            row = {
                "a": a, "k": k, "tokens_per_s": tps, "speedup": tps / base_tps,
                "expected_speedup": specrs.expected_speedup(a, k, 0.0, ratios),
                # Should be about a: the first position's acceptance is not conditioned on others.
                "acceptance_first_position": m["acceptance_rate_per_pos"][0],
                "mean_acceptance_length": m["mean_acceptance_length"],
                "expected_acceptance_length": (1 - a ** (k + 1)) / (1 - a),
                # After the forward's sync: the acceptance kernel, its copies and the bookkeeping.
                "verify_share": m["verify_s"] / (m["forward_s"] + m["verify_s"]),
                "matches_baseline": result.token_ids == reference,
            }
            rows.append(row)
            print(f"(c) a={a} k={k}: {row}", flush=True)
    baseline_again = engine.generate(prompt, params)
    return {
        "shape": config, "dtype": dtype, "weight_bytes": info["weight_bytes"], "build_s": build_s,
        "copy_bandwidth_bytes_per_s": bandwidth, "hbm_bound_s": bound_s,
        "baseline_itl_s": base_itl, "baseline_tokens_per_s": base_tps,
        "baseline_again_tokens_per_s": decode_rate(baseline_again)[0],
        "verify_cost_ratios": ratios, "rows": rows,
    }


def table(report: dict) -> str:
    c = report["c"]
    lines = [
        f"device {report['device']}: baseline ITL {c['baseline_itl_s'] * 1e3:.3f} ms vs HBM bound "
        f"{c['hbm_bound_s'] * 1e3:.3f} ms = {c['baseline_itl_s'] / c['hbm_bound_s']:.2f}x (goal <= 1.3x); "
        f"baseline {c['baseline_tokens_per_s']:.1f} tok/s (again at the end: {c['baseline_again_tokens_per_s']:.1f})",
        "",
        "| a | k | tok/s | speedup | expected | acc. pos 1 | acc. len | expected | verify share | = baseline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in c["rows"]:
        lines.append(
            f"| {r['a']} | {r['k']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['expected_speedup']:.2f}x | "
            f"{r['acceptance_first_position']:.2f} | {r['mean_acceptance_length']:.2f} | "
            f"{r['expected_acceptance_length']:.2f} | {r['verify_share'] * 100:.2f}% | "
            f"{'yes' if r['matches_baseline'] else 'no'} |"
        )
    goal = next(r for r in c["rows"] if r["a"] == 0.9 and r["k"] == 4)
    lines.append("")
    lines.append(f"goals: ITL/bound {c['baseline_itl_s'] / c['hbm_bound_s']:.2f} (<= 1.3); a=0.9 k=4 speedup "
                 f"{goal['speedup']:.2f}x (>= 3x); verify share {goal['verify_share'] * 100:.2f}% (< 2%)")
    checks = [("a", fmt, r["ok"]) for fmt, r in report["a"].items() if "ok" in r]
    checks += [("b", name, r["ok"]) for name, r in report["b"].items() if isinstance(r, dict) and "ok" in r]
    identical = sum(g["identical"] for g in report["a"]["greedy_identity"].values())
    lines.append("checks: " + ", ".join(f"({p}) {n} {'PASS' if ok else 'FAIL'}" for p, n, ok in checks)
                 + f"; greedy identity {identical}/{len(report['a']['greedy_identity'])}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", help="install this specrs wheel first (into /tmp, not the system)")
    parser.add_argument("--device", default="cuda", help="cuda[:N]; falls back to the CPU without one")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per timed request in (c)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    ensure_cuda_libraries()
    if args.wheel:
        install_wheel(args.wheel)
    import specrs

    device = args.device
    if device != "cpu":
        try:
            specrs._specrs.copy_bandwidth(device, 1 << 20, 1)
        except specrs.SpecrsError as e:
            print(f"no CUDA device ({e}); running the CPU parts at a small shape", flush=True)
            device = "cpu"
    report = {"device": device, "cuda_library_dirs": os.environ.get("LD_LIBRARY_PATH", "")}
    report["a"] = part_a(specrs, device)
    report["b"] = part_b(specrs, device)
    report["c"] = part_c(specrs, device, args.tokens)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print("\n" + table(report))
    failed = [fmt for fmt, r in report["a"].items() if not r.get("ok", True)]
    failed += [name for name, r in report["b"].items() if isinstance(r, dict) and not r.get("ok", True)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
