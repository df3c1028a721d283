"""The candle-ops Llama (what device="cuda" runs) through `Engine.random`, on the CPU here and on
CUDA when this is a CUDA build on a GPU machine (skipped otherwise), and the GPU check script's
CPU mode."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import specrs

TINY = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
PROMPT = [(i * 37 + 11) % 512 for i in range(20)]


class Replay:
    """Drafts the target's own greedy continuation, each token corrupted with probability
    1 - acceptance, so most steps verify several tokens and some reject."""

    def __init__(self, reference, prompt_len, acceptance, seed):
        self.reference, self.prompt_len, self.acceptance = reference, prompt_len, acceptance
        self.rng = random.Random(seed)

    def propose(self, context_ids, max_tokens):
        start = len(context_ids) - self.prompt_len
        return [
            t if self.rng.random() < self.acceptance else (t + 1) % TINY["vocab_size"]
            for t in self.reference[start : start + max_tokens]
        ]


@pytest.fixture(scope="module", params=["f32", "bf16", "q8_0"])
def random_engine(request):
    return specrs.Engine.random(TINY, seed=7, dtype=request.param)


def test_same_seed_same_weights_other_seed_other_weights():
    a = specrs.Engine.random(TINY, seed=1, dtype="f32").logits(PROMPT)
    b = specrs.Engine.random(TINY, seed=1, dtype="f32").logits(PROMPT)
    c = specrs.Engine.random(TINY, seed=2, dtype="f32").logits(PROMPT)
    assert np.array_equal(a, b)
    assert not np.allclose(a, c)
    assert a.shape == (len(PROMPT), TINY["vocab_size"]) and np.isfinite(a).all()


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculation_is_identical_on_the_candle_model(random_engine, k):
    params = specrs.SamplingParams(max_tokens=48, temperature=0.0)
    plain = random_engine.generate(PROMPT, params)
    assert plain.finish_reason == "length" and len(plain.token_ids) == 48
    config = {"method": "custom", "num_speculative_tokens": k, "adaptive_draft_length": False}
    spec = random_engine.generate(
        PROMPT, params, speculative_config=config, proposer=Replay(plain.token_ids, len(PROMPT), 0.8, seed=k)
    )
    assert spec.token_ids == plain.token_ids
    m = spec.metrics
    assert m["num_drafts"] > 0 and 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert m["num_forward_passes"] < plain.metrics["num_forward_passes"]
    for method in ("ngram", "suffix"):
        other = random_engine.generate(
            PROMPT * 2, params, speculative_config={"method": method, "num_speculative_tokens": k}
        )
        assert other.token_ids == random_engine.generate(PROMPT * 2, params).token_ids


def test_a_paged_pool_on_the_candle_model_keeps_greedy_identity():
    # The candle decoder on a paged pool (bf16 tensors on its device): one write and one attention
    # op per layer for the step, speculative output = plain output on the same engine.
    paged = specrs.Engine.random(TINY, seed=7, dtype="bf16", kv_layout="paged", kv_block_size=8, max_kv_tokens=256)
    assert paged.kv_pool == {"block_size": 8, "num_blocks": 32, "num_free": 32}
    params = specrs.SamplingParams(max_tokens=48, temperature=0.0)
    plain = paged.generate(PROMPT, params)
    config = {"method": "custom", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    spec = paged.generate(PROMPT, params, speculative_config=config,
                          proposer=Replay(plain.token_ids, len(PROMPT), 0.8, seed=4))
    assert spec.token_ids == plain.token_ids and spec.metrics["num_drafts"] > 0
    assert paged.kv_pool["num_free"] == 32
    with pytest.raises(specrs.ConfigError, match="power of two"):
        specrs.Engine.random(TINY, kv_layout="paged", kv_block_size=3)
    with pytest.raises(specrs.ConfigError, match="max_kv_tokens must be a positive number"):
        specrs.Engine.random(TINY, kv_layout="paged", max_kv_tokens=0)


def test_seeded_sampling_is_reproducible_with_speculation():
    engine = specrs.Engine.random(TINY, seed=3, dtype="f32")
    params = specrs.SamplingParams(max_tokens=32, temperature=0.8, seed=11)
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    runs = [engine.generate(PROMPT * 2, params, speculative_config=config).token_ids for _ in range(2)]
    assert runs[0] == runs[1]
    other = specrs.SamplingParams(max_tokens=32, temperature=0.8, seed=12)
    assert engine.generate(PROMPT * 2, other, speculative_config=config).token_ids != runs[0]


def test_numbered_tokenizer_and_info():
    engine = specrs.Engine.random(TINY, seed=0, dtype="bf16")
    assert engine.tokenizer.encode("t1 t22 t3") == [1, 22, 3]
    assert engine.tokenizer.decode([4, 5]) == "t4 t5"
    info = engine.info()
    assert (info["architecture"], info["vocab_size"], info["num_layers"], info["device"]) == ("llama", 512, 3, "Cpu")
    # bf16 weights (2 bytes each) of every matrix and the embedding.
    per_layer = 2 * 256 * 256 + 2 * 64 * 256 + 3 * 512 * 256
    assert info["weight_bytes"] == 2 * (3 * per_layer + 2 * 512 * 256)


def test_bad_random_configs_name_the_fix():
    with pytest.raises(specrs.ConfigError, match="hiden_size"):
        specrs.Engine.random({**TINY, "hiden_size": 3})
    with pytest.raises(specrs.ConfigError, match="unknown dtype 'f8'"):
        specrs.Engine.random(TINY, dtype="f8")
    with pytest.raises(specrs.ConfigError, match="divisible by 256"):
        specrs.Engine.random({**TINY, "intermediate_size": 384}, dtype="q4_k")
    with pytest.raises(specrs.ModelLoadError, match="inconsistent attention shape"):
        specrs.Engine.random({**TINY, "num_attention_heads": 7})
    with pytest.raises(specrs.ConfigError, match="quantized_self"):
        specrs.Engine.random(TINY, dtype="f32").generate(
            PROMPT, specrs.SamplingParams(temperature=0, max_tokens=4), speculative_config={"method": "quantized_self"}
        )
    with pytest.raises(specrs.ConfigError, match="cuda:N"):
        specrs.Engine.random(TINY, device="cuda:x")


def test_read_bandwidth_and_the_bytes_a_step_reads():
    rate = specrs._specrs.read_bandwidth("cpu", 64 << 20, 3)
    assert rate > 0  # bytes over the best pass's seconds; no speed is asserted
    with pytest.raises(specrs.ConfigError, match="1 MiB"):
        specrs._specrs.read_bandwidth("cpu", 1000, 3)
    engine = specrs.Engine.random(TINY, seed=0, dtype="bf16")
    info = engine.info()
    # No embedding table in a step; the KV grows with the context, by the same bytes per position.
    assert engine.step_read_bytes(0) == info["step_weight_bytes"] < info["weight_bytes"]
    per_position = engine.step_read_bytes(1) - engine.step_read_bytes(0)
    assert per_position > 0 and engine.step_read_bytes(100) - engine.step_read_bytes(0) == 100 * per_position


def test_the_decoder_kernels_reference_checks_itself_on_the_cpu():
    report = specrs._specrs.check_decoder_kernels("cpu")
    assert {"add_rms_norm norm F32", "silu_mul BF16", "gelu_mul F32", "paged_attention window 8 BF16"} <= set(report)
    assert all(row["ok"] and row["max_abs_diff"] == 0.0 for row in report.values())


def test_cuda_device_errors_name_the_build_or_the_device():
    try:
        specrs.Engine.random(TINY, device="cuda")
    except specrs.DeviceError as e:
        assert "CUDA build" in str(e) or "cannot open CUDA device" in str(e), str(e)
    else:
        pytest.skip("CUDA is available here")


@pytest.mark.parametrize("dtype,tolerance", [("f32", 1e-3), ("bf16", 5e-2), ("q8_0", 5e-2)])
def test_cuda_logits_match_the_cpu(dtype, tolerance, cuda):
    cpu = specrs.Engine.random(TINY, seed=5, dtype=dtype).logits(PROMPT)
    gpu = specrs.Engine.random(TINY, seed=5, dtype=dtype, device="cuda").logits(PROMPT)
    assert np.abs(cpu - gpu).max() <= tolerance * np.abs(cpu).max()
    assert (cpu.argmax(axis=1) == gpu.argmax(axis=1)).mean() >= 0.9


def test_cuda_greedy_speculation_is_identical(cuda):
    engine = specrs.Engine.random(TINY, seed=5, dtype="f32", device="cuda")
    params = specrs.SamplingParams(max_tokens=48, temperature=0.0)
    plain = engine.generate(PROMPT, params).token_ids
    config = {"method": "custom", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    spec = engine.generate(PROMPT, params, speculative_config=config, proposer=Replay(plain, len(PROMPT), 0.8, 1))
    assert spec.token_ids == plain


SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402


def test_gpu_check_script_runs_its_cpu_parts(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tokens", "24", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["device"] == "cpu" and report["b"] == {"skipped": "no CUDA device"}
    # On the CPU every weight format runs specrs' row-independent kernels (dense ones through
    # kernels/dense.rs; candle's own gemm rounded a bf16 verify row up to 0.03 off its single
    # step), so there are no near-ties to excuse: every greedy run is plain greedy, token for token.
    assert report["failures"] == []
    assert report["near_ties"] == []
    assert all(r["ok"] for fmt, r in report["a"].items() if fmt != "greedy_identity")
    greedy = report["a"]["greedy_identity"]
    assert list(greedy) == ["f32 k=2", "f32 k=4", "f32 k=8", "bf16 k=2", "bf16 k=4", "bf16 k=8", "q8_0 k=8", "q4_k k=8"]
    assert all(g["num_drafts"] > 0 and g["ok"] and g["identical"] for g in greedy.values())
    rows = report["c"]["rows"]
    assert [(r["a"], r["k"]) for r in rows] == [(a, k) for a in (0.5, 0.7, 0.9) for k in (2, 4, 8)]
    # Every replay matched, so each was timed over all its decode tokens.
    assert all(r["matches_baseline"] and r["ok"] and r["timed_tokens"] == 23 for r in rows)
    sampled = report["c"]["sampled"]
    assert sampled["ok"] and sampled["num_drafts"] > 0 and sampled["temperature"] > 0
    processed = report["d"]
    assert list(processed) == ["greedy", "sampled", "samples"] and all(r["ok"] for r in processed.values()), processed
    trees = report["e"]
    assert list(trees) == ["greedy", "sampled"] and all(r["ok"] for r in trees.values()), trees
    lines = run.stdout.rstrip().splitlines()
    assert lines[-2 - len(report["near_ties"])].startswith("checks:")
    assert lines[-1] == f"gpu_check PASS on cpu: 0 failures, {len(report['near_ties'])} near-ties"


def test_gpu_check_fails_when_the_cuda_device_cannot_be_opened(tmp_path):
    try:
        gpu_check.open_device(specrs, "cuda")
        pytest.skip("a CUDA device opens here; the GPU check itself runs the full script")
    except specrs.DeviceError:
        pass
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    # No silent CPU-against-CPU run: asked for a GPU it cannot open, the check fails.
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAIL: cannot open cuda" in run.stdout and "--device cpu" in run.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failures"][0].startswith("cannot open cuda") and "a" not in report


def test_gpu_check_records_kernel_failures_and_decides_on_them(monkeypatch):
    """A kernel that fails to compile or launch, or that disagrees with its CPU reference, is a
    failure of part (b) (simulated here: the device calls are replaced)."""
    small_inputs, small_trees = gpu_check.random_accept_inputs, gpu_check.random_tree_accept_inputs
    monkeypatch.setattr(gpu_check, "random_accept_inputs", lambda b, k, v, seed, p: small_inputs(16, k, 64, seed, p))
    monkeypatch.setattr(gpu_check, "random_tree_accept_inputs", lambda b, n, v, seed: small_trees(64, n, 64, seed))
    cpu_accept, cpu_ngram = specrs._specrs.batch_accept, specrs._specrs.batch_ngram
    cpu_tree_accept = specrs._specrs.batch_tree_accept

    def accept(*args, draft_probs=None, device="cpu"):
        if device != "cpu":
            raise specrs.DeviceError("launching accept_kernel: simulated launch failure")
        return cpu_accept(*args, draft_probs=draft_probs)

    def wrong_ngram(*args, device="cpu"):
        drafts, lengths = cpu_ngram(*args)
        return (drafts, [n + 1 for n in lengths]) if device != "cpu" else (drafts, lengths)

    def tree_accept_one_too_deep_when_greedy(*args, device="cpu"):
        """The CPU reference, but on the device every greedy sequence that accepted a node claims one more."""
        accepted, path, next_token = cpu_tree_accept(*args)
        if device != "cpu":
            greedy = (args[4] == 0) & (accepted > 0)
            accepted = accepted + greedy
        return accepted, path, next_token

    monkeypatch.setattr(specrs._specrs, "batch_accept", accept)
    monkeypatch.setattr(specrs._specrs, "batch_ngram", wrong_ngram)
    monkeypatch.setattr(specrs._specrs, "batch_tree_accept", tree_accept_one_too_deep_when_greedy)
    b = gpu_check.part_b(specrs, "cuda")
    assert b["accept"] == b["accept_with_probs"] == {"ok": False, "error": "launching accept_kernel: simulated launch failure"}
    assert b["ngram"] == {"ok": False}
    greedy_wrong = b["tree_accept"]["greedy_mismatches"]
    assert greedy_wrong > 0 and b["tree_accept"]["sampled_mismatches"] == 0 and not b["tree_accept"]["ok"]
    failures = gpu_check.failures({"device": "cuda", "b": b})
    assert failures == ["(b) accept kernel: launching accept_kernel: simulated launch failure",
                        "(b) accept_with_probs kernel: launching accept_kernel: simulated launch failure",
                        f"(b) tree_accept kernel: {greedy_wrong} greedy and 0 of {b['tree_accept']['sampled_sequences']} "
                        "sampled sequences differ from the CPU reference",
                        "(b) ngram kernel: drafts differ from the CPU reference"]


def test_gpu_check_failures_cover_greedy_identity_and_replays():
    report = {
        "device": "cuda",
        "a": {
            "f32": {"ok": True, "rel_max_diff": 1e-5, "top1_agreement": 1.0},
            "bf16": {"ok": False, "rel_max_diff": 0.2, "top1_agreement": 0.5},
            "greedy_identity": {
                "f32 k=2": {"identical": True, "num_drafts": 20, "ok": True},
                "q8_0 k=8": {"identical": False, "num_drafts": 9, "diverged_at": 17, "logit_gap": 0.8,
                             "relative_gap": 0.16, "near_tie": False, "ok": False},
                "q4_k k=8": {"identical": False, "num_drafts": 9, "diverged_at": 5, "logit_gap": 0.001,
                             "relative_gap": 2e-4, "near_tie": True, "ok": True},
                "bf16 k=4": {"identical": True, "num_drafts": 0, "ok": False},
            },
        },
        "c": {"error": "DeviceError: out of memory"},
    }
    assert gpu_check.failures(report) == [
        "(c) raised DeviceError: out of memory",
        "(a) bf16 logits cuda vs cpu: relative max difference 0.2 (tolerance 0.05), top-1 agreement 0.500 (floor 0.9)",
        "(a) greedy identity q8_0 k=8: diverged from plain greedy at token 17 (logit gap 0.8 = 0.16 of the largest logit)",
        "(a) greedy identity bf16 k=4: no draft was made",
    ]
    assert gpu_check.near_ties(report) == ["(a) q4_k k=8: near-tie at token 5 (logit gap 0.001 = 0.0002 of the largest logit)"]
    rows = [{"a": 0.9, "k": 8, "ok": False, "num_drafts": 3, "matches_baseline": False, "diverged_at": 40,
             "logit_gap": 1.5, "relative_gap": 0.3, "near_tie": False}]
    assert gpu_check.failures({"device": "cuda", "c": {"rows": rows}}) == [
        "(c) a=0.9 k=8: does not match the baseline (diverged at token 40, logit gap 1.5 = 0.3 of the largest logit)"]


def test_gpu_check_times_a_replay_only_up_to_its_first_divergence():
    engine = specrs.Engine.random(TINY, seed=4, dtype="f32")
    params = specrs.SamplingParams(max_tokens=32, temperature=0.0)
    plain = gpu_check.timed_run(engine, PROMPT, params)
    assert plain["diverged_at"] is None and len(plain["tokens"]) == 32 and plain["timed_tokens"] == 31
    # A recorded sequence that departs from what the target generates at token 12: timing stops there.
    recorded = list(plain["tokens"])
    recorded[12] = (recorded[12] + 1) % TINY["vocab_size"]
    config = {"method": "custom", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    run = gpu_check.timed_run(engine, PROMPT, params, recorded, speculative_config=config,
                              proposer=gpu_check.SyntheticProposer(recorded, len(PROMPT), 1.0, TINY["vocab_size"], 0))
    assert run["diverged_at"] == 12 and run["tokens"][:12] == plain["tokens"][:12]
    assert 0 < run["timed_tokens"] < 12 and run["metrics"]["num_drafts"] > 0
    # Where the two differ, the target's logits are far from a tie, so this is a failure.
    where = gpu_check.divergence(engine, PROMPT, plain["tokens"], recorded, gpu_check.NEAR_TIE["f32"])
    assert where["diverged_at"] == 12 and where["logit_gap"] > 0 and where["near_tie"] is False
    row = engine.logits(PROMPT + plain["tokens"][:12])[-1]
    runner_up = int(np.argsort(row)[-2])
    tie = gpu_check.divergence(engine, PROMPT, plain["tokens"], plain["tokens"][:12] + [runner_up], 1.0)
    assert tie["near_tie"] is True and tie["logit_gap"] == pytest.approx(float(row.max() - row[runner_up]))


BENCH = SCRIPT.parent / "gpu_bench.py"


def test_gpu_bench_script_runs_its_cpu_mode(tmp_path):
    """The GPU step's device benchmark, in its CPU mode (the same code at a small shape): every
    part runs, the identities hold, and the bound is the engine's bytes over the read rate."""
    run = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--tokens", "8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report["failures"] == [] and report["kv_layout"] == "paged"  # the step over the paged pool
    bound = report["bound"]
    assert bound["bound_s"] == pytest.approx(bound["step_read_bytes"] / bound["read_bandwidth_bytes_per_s"])
    assert bound["step_read_bytes"] < report["engine"]["weight_bytes"]  # no embedding table
    assert all(r["ok"] for r in report["kernels"]["decoder"].values())
    assert {"paged_attention write normed BF16", "paged_attention softcap normed F32"} <= set(report["kernels"]["decoder"])
    assert report["identity"]["greedy"]["ok"] and report["identity"]["seeded_repeat"]["identical"]
    for batch in ("1", "8", "32"):
        row = report["batches"][batch]
        assert row["plain"]["repeatable"] and all(row[f"a={a} k=4"]["ok"] for a in (0.9, 0.7)), row
        # n-gram and suffix drafts from batch 8 on (looked up together on a GPU): plain greedy's tokens.
        for lookup in ("ngram k=4", "suffix k=4"):
            assert (lookup in row) == (batch != "1") and row.get(lookup, {"ok": True})["ok"], row
    assert run.stdout.rstrip().splitlines()[-1].startswith("gpu_bench PASS on cpu: 0 failures")


def test_step_graphs_are_off_on_the_cpu_and_their_settings_are_checked():
    # A paged engine captures its steps as CUDA graphs on CUDA only: here the candle model says
    # its graphs are off and ran every step eagerly without counting it; the CPU decoder has none.
    paged = specrs.Engine.random(TINY, seed=7, dtype="bf16", kv_layout="paged", kv_block_size=8, max_kv_tokens=256,
                                 cuda_graph_memory_mb=64)
    paged.generate(PROMPT, specrs.SamplingParams(max_tokens=4, temperature=0.0))
    status = paged.step_graph_status()
    assert status["mode"] == "off" and status["budget_bytes"] == 64 << 20
    assert set(status["num_eager"]) == {"warmup", "shape", "budget", "busy", "room", "capture_failed"}
    counts = [status[k] for k in ("num_graphs", "num_captures", "num_replays", "used_bytes")]
    assert counts == [0, 0, 0, 0] and sum(status["num_eager"].values()) == 0
    assert specrs.Engine.random(TINY, enforce_eager=True).step_graph_status()["mode"] == "off"
    for bad in ({"enforce_eager": 1}, {"cuda_graph_memory_mb": -1}, {"cuda_graph_memory_mb": 1.5},
                {"cuda_graph_memory_mb": True}):
        with pytest.raises(specrs.ConfigError, match=next(iter(bad))):
            specrs.Engine.random(TINY, **bad)


def test_metrics_report_the_captured_steps():
    from specrs.serve.metrics import ServerMetrics

    status = {"mode": "device", "budget_bytes": 4 << 30, "used_bytes": 123_456, "num_graphs": 2,
              "num_graph_nodes": 70, "num_captures": 2, "num_replays": 40, "capture_error": None,
              "num_eager": {"warmup": 2, "shape": 1, "budget": 0, "busy": 0, "room": 0, "capture_failed": 0}}
    metrics = ServerMetrics("m")
    metrics.report_step_graphs(lambda: status)
    text = metrics.render().decode()
    for line in ('specrs:cuda_graph_replays_total{model_name="m"} 40.0',
                 'specrs:cuda_graph_captures_total{model_name="m"} 2.0',
                 'specrs:cuda_graph_eager_steps_total{model_name="m",reason="shape"} 1.0',
                 'specrs:cuda_graph_eager_steps_total{model_name="m",reason="capture_failed"} 0.0',
                 'specrs:cuda_graphs{model_name="m"} 2.0',
                 'specrs:cuda_graph_memory_bytes{model_name="m"} 123456.0',
                 'specrs:cuda_graph_memory_budget_bytes{model_name="m"} 4.294967296e+09'):
        assert line in text, line
    status["num_replays"] = 41  # read at every scrape
    assert 'specrs:cuda_graph_replays_total{model_name="m"} 41.0' in metrics.render().decode()
    none = ServerMetrics("n")
    none.report_step_graphs(lambda: None)  # a model that captures nothing (the CPU decoder)
    assert "cuda_graph" not in none.render().decode()
