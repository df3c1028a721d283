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
from gpu_check import random_accept_inputs  # noqa: E402  (the GPU check uses the same inputs)


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


def _cuda_or_skip():
    """Skips where no GPU can be used (a CPU-only build, or no device that opens). The probe is a
    device copy, which runs none of our kernels, so a kernel that fails to compile or launch on a
    present GPU raises in the test itself: a failure, not a skip."""
    try:
        _specrs.copy_bandwidth("cuda", 1 << 20, 1)
    except specrs.DeviceError as e:
        pytest.skip(f"no CUDA here: {e}")


@pytest.mark.parametrize("with_probs", [False, True])
def test_cuda_acceptance_equals_the_cpu_reference(with_probs):
    _cuda_or_skip()
    inputs = random_accept_inputs(512, 4, 32000, seed=3, with_probs=with_probs)
    cpu = _specrs.batch_accept(*inputs[:5], draft_probs=inputs[5])
    gpu = _specrs.batch_accept(*inputs[:5], draft_probs=inputs[5], device="cuda")
    assert gpu[0] == cpu[0]
    # A sampled draw sums floats in another order; only a uniform within rounding of a CDF
    # boundary may pick the neighbouring token.
    assert sum(a != b for a, b in zip(gpu[1], cpu[1])) <= 2


def test_cuda_ngram_equals_the_cpu_reference():
    _cuda_or_skip()
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

    monkeypatch.setattr(_specrs, "copy_bandwidth", lambda device, num_bytes, repeats: 1e12)
    monkeypatch.setattr(_specrs, "batch_ngram", ngram)
    try:
        test_cuda_ngram_equals_the_cpu_reference()
    except pytest.skip.Exception as e:
        pytest.fail(f"a kernel failure on a present GPU was skipped: {e}")
    except specrs.DeviceError as e:
        assert "simulated compile failure" in str(e)
    else:
        pytest.fail("the kernel's error did not reach the test")
