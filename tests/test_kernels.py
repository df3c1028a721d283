"""The batched kernels through Python: the CPU references (always), and the CUDA kernels against
them on random inputs when this is a CUDA build on a machine with a GPU (skipped otherwise). On a
machine with a GPU, a kernel that fails to compile or launch fails its test: only a device that
cannot be opened skips."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import specrs
from specrs import _specrs

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
# The GPU check uses the same inputs and the same account of sampled mismatches.
from gpu_check import (  # noqa: E402
    explain_accept_mismatches,
    explain_tree_mismatches,
    open_device,
    random_accept_inputs,
    random_tree_accept_inputs,
    target_probs,
)


def test_cpu_acceptance_greedy_rows():
    logits, drafts, num_draft, _, uniforms, _ = random_accept_inputs(64, 4, 50, seed=1, with_probs=False)
    accepted, next_ids = _specrs.batch_accept(logits, drafts, num_draft, [0.0] * 64, uniforms)
    for s in range(64):
        argmax = logits[s].argmax(axis=1)
        expected = next((i for i in range(num_draft[s]) if argmax[i] != drafts[s, i]), num_draft[s])
        assert (accepted[s], next_ids[s]) == (expected, argmax[expected])
    assert 0 < sum(a == n for a, n in zip(accepted, num_draft)) < 64


def test_cpu_ngram_matches_the_rule():
    histories = np.array([[1, 2, 3, 1, 2, 9, 9], [5, 6, 7, 8, 0, 0, 0]], dtype=np.uint32)
    drafts, lengths = _specrs.batch_ngram(histories, [5, 4], 1, 3, 3)
    # [1 2 3 1 2]: "1 2" occurred at 0..2, followed by "3 1 2"; [5 6 7 8] repeats nothing.
    assert lengths == [3, 0] and drafts[:3] == [3, 1, 2]


def test_bad_input_and_devices():
    logits, drafts, num_draft, temps, uniforms, _ = random_accept_inputs(2, 2, 8, seed=0, with_probs=False)
    with pytest.raises(specrs.SpecrsError, match="uniforms has 3 values, expected 6"):
        _specrs.batch_accept(logits, drafts, num_draft, temps, uniforms[:1, :])
    with pytest.raises(specrs.ConfigError, match="unknown device"):
        _specrs.batch_ngram(np.zeros((1, 4), dtype=np.uint32), [4], 1, 2, 2, device="tpu")


def _tree_walk(logits, drafts, parents, count, temperature, uniforms):
    """The tree walk of batch/tree_accept.rs in float64: `(path, next_token, near_boundary)`, where
    near_boundary says a sampled draw's uniform lay within rounding of a CDF boundary (there the f32
    reference may pick the neighbouring token)."""
    path, current, near_boundary = [], -1, False
    while True:
        row = logits[current + 1].astype(np.float64)
        if temperature == 0:
            target = int(np.argmax(row))  # the first of equal maxima, as sampler::argmax
        else:
            cdf = np.cumsum(target_probs(row, temperature))
            u = float(uniforms[len(path)])
            target = min(int(np.searchsorted(cdf, u, side="right")), len(row) - 1)  # first cdf > u
            near_boundary |= bool(np.abs(cdf - u).min() < 1e-5)
        child = next((i for i in range(count) if parents[i] == current and drafts[i] == target), None)
        if child is None:
            return path, target, near_boundary
        path.append(child)
        current = child


@pytest.mark.parametrize("temperatures", [[0.0], [0.5, 1.0, 1.3]], ids=["greedy", "sampled"])
def test_cpu_tree_acceptance_matches_the_walk(temperatures):
    logits, drafts, parents, num_nodes, _, uniforms = random_tree_accept_inputs(96, 8, 50, seed=2)
    temps = np.array([temperatures[s % len(temperatures)] for s in range(96)], dtype=np.float32)
    accepted, paths, next_ids = _specrs.batch_tree_accept(logits, drafts, parents, num_nodes, temps, uniforms)
    assert paths.shape == (96, 8) and accepted.dtype == paths.dtype == next_ids.dtype == np.uint32
    endings, compared = set(), 0
    for s in range(96):
        count = int(num_nodes[s])
        path, target, near_boundary = _tree_walk(logits[s], drafts[s], parents[s], count, temps[s], uniforms[s])
        if near_boundary:
            continue
        compared += 1
        assert accepted[s] == len(path), s
        assert list(paths[s, : len(path)]) == path and (paths[s, len(path):] == 2**32 - 1).all(), s
        assert next_ids[s] == target, s
        has_children = (parents[s, :count] == (path[-1] if path else -1)).any()
        endings.add(("deep" if path else "root") + (" rejected" if has_children else " leaf/empty"))
    assert compared >= 90
    assert endings == {"root rejected", "root leaf/empty", "deep rejected", "deep leaf/empty"}, endings


def test_tree_acceptance_bad_input():
    logits, drafts, parents, num_nodes, temps, uniforms = random_tree_accept_inputs(2, 3, 8, seed=0)
    with pytest.raises(specrs.ConfigError, match="uniforms has 3 values, expected 8"):
        _specrs.batch_tree_accept(logits, drafts, parents, num_nodes, temps, uniforms[:1, :3])
    with pytest.raises(specrs.ConfigError, match="parents has 3 values, expected 6"):
        _specrs.batch_tree_accept(logits, drafts, parents[:1], num_nodes, temps, uniforms)
    bad = np.array([[-1, 1, 0], [-1, 0, 0]], dtype=np.int32)  # node 1 is its own parent
    with pytest.raises(specrs.ConfigError, match="parent 1 of node 1 in sequence 0"):
        _specrs.batch_tree_accept(logits, drafts, bad, [3, 3], temps, uniforms)
    with pytest.raises(specrs.ConfigError, match="num_nodes 4 exceeds max_nodes 3"):
        _specrs.batch_tree_accept(logits, drafts, parents, [4, 0], temps, uniforms)
    with pytest.raises(specrs.ConfigError, match="uniforms must lie in"):
        _specrs.batch_tree_accept(logits, drafts, parents, num_nodes, temps, uniforms + 1.0)
    with pytest.raises(specrs.ConfigError, match="unknown device"):
        _specrs.batch_tree_accept(logits, drafts, parents, num_nodes, temps, uniforms, device="tpu")


@pytest.mark.parametrize("with_probs", [False, True])
def test_cuda_acceptance_equals_the_cpu_reference(with_probs, cuda):
    inputs = random_accept_inputs(512, 4, 32000, seed=3, with_probs=with_probs)
    cpu = _specrs.batch_accept(*inputs[:5], draft_probs=inputs[5])
    gpu = _specrs.batch_accept(*inputs[:5], draft_probs=inputs[5], device="cuda")
    # A sampled draw sums floats in another order: only a uniform within rounding of a CDF
    # boundary may pick the neighbouring token.
    report = explain_accept_mismatches(inputs, cpu, gpu)
    assert report["ok"], report


def test_cuda_tree_acceptance_equals_the_cpu_reference(cuda):
    inputs = random_tree_accept_inputs(256, 16, 32000, seed=4)
    cpu = _specrs.batch_tree_accept(*inputs)
    gpu = _specrs.batch_tree_accept(*inputs, device="cuda")
    # Greedy walks are exact; a sampled draw within rounding of a CDF boundary may pick the
    # neighbouring token, and with it another path.
    report = explain_tree_mismatches(inputs, cpu, gpu)
    assert report["ok"], report


def test_the_mismatch_account_explains_rounding_and_catches_wrong_draws():
    """What the GPU tests and scripts/gpu_check.py accept, checked on the CPU: results of slightly
    perturbed logits (rounding-sized) pass; a draw moved to another token, a greedy difference or
    a changed accepted count far from its test's boundary fail."""
    inputs = random_accept_inputs(512, 4, 32000, seed=3, with_probs=False)
    cpu = _specrs.batch_accept(*inputs[:5])
    rounded = _specrs.batch_accept(inputs[0] * np.float32(1 + 3e-7), *inputs[1:5])
    assert explain_accept_mismatches(inputs, cpu, rounded)["ok"]
    temperatures = inputs[3]
    sampled = [s for s, t in enumerate(temperatures) if t > 0]
    greedy = next(s for s, t in enumerate(temperatures) if t == 0)
    drafted = next(s for s in sampled if inputs[2][s] > 0)
    for s, change in ((sampled[0], "token"), (greedy, "token"), (drafted, "count")):
        wrong = (list(cpu[0]), list(cpu[1]))
        if change == "token":
            wrong[1][s] = (wrong[1][s] + 1000) % 32000
        else:
            wrong[0][s] = (wrong[0][s] + 1) % (inputs[2][s] + 1)
        assert not explain_accept_mismatches(inputs, cpu, wrong)["ok"], (s, change)

    tree_inputs = random_tree_accept_inputs(256, 16, 32000, seed=4)
    tree = _specrs.batch_tree_accept(*tree_inputs)
    rounded = _specrs.batch_tree_accept(tree_inputs[0] * np.float32(1 + 3e-7), *tree_inputs[1:])
    assert explain_tree_mismatches(tree_inputs, tree, rounded)["ok"]
    s = int(np.nonzero(tree_inputs[4] > 0)[0][0])
    wrong = (tree[0].copy(), tree[1].copy(), tree[2].copy())
    wrong[2][s] = (wrong[2][s] + 1000) % 32000
    wrong[0][s], wrong[1][s] = 0, 2**32 - 1  # stopped at the root with another token
    assert not explain_tree_mismatches(tree_inputs, tree, wrong)["ok"]


def test_cuda_ngram_equals_the_cpu_reference(cuda):
    rng = np.random.default_rng(5)
    histories = rng.integers(0, 4, size=(256, 2048), dtype=np.uint32)
    lengths = [int(n) for n in rng.integers(1, 2049, size=256)]
    assert _specrs.batch_ngram(histories, lengths, 2, 5, 8, device="cuda") == _specrs.batch_ngram(histories, lengths, 2, 5, 8)


def test_a_kernel_that_fails_on_a_present_gpu_fails_its_test(monkeypatch):
    """A GPU that opens (the probe succeeds) but an NVRTC compile failure in the kernel: the kernel
    test must fail with the kernel's error, not skip."""
    cpu_ngram = _specrs.batch_ngram

    def ngram(*args, device="cpu"):
        if device != "cpu":
            raise specrs.DeviceError("NVRTC on ngram.cu: simulated compile failure")
        return cpu_ngram(*args)

    monkeypatch.setattr(_specrs, "read_bandwidth", lambda device, num_bytes, repeats: 1e12)
    monkeypatch.setattr(_specrs, "batch_ngram", ngram)
    try:
        open_device(specrs, "cuda")  # the `cuda` fixture's probe (conftest.py): it passes
        test_cuda_ngram_equals_the_cpu_reference("cuda")
    except pytest.skip.Exception as e:
        pytest.fail(f"a kernel failure on a present GPU was skipped: {e}")
    except specrs.DeviceError as e:
        assert "simulated compile failure" in str(e)
    else:
        pytest.fail("the kernel's error did not reach the test")
