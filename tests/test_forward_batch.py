"""`Engine.forward_batch` and `Engine.hidden_states` (the forward contract, model/forward.rs) from
Python: on the real models a row's logits and hidden states are bitwise the same alone and inside a
batch of other sequences, as a tree node and as its path's chain (Gemma 3 also past its 512-token
sliding window); the hidden-state taps equal transformers' `output_hidden_states` on the tiny HF
model of every family (tests/golden/hf/<family>/hidden.json, scripts/make_hf_hidden_golden.py);
bad input is a ConfigError that says what to change."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import specrs

GOLDEN = Path(__file__).parent / "golden" / "hf"
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]
# Max |difference| over the largest |value| of each tap, as tests/test_hf_golden.py bounds the
# logits: f32 weights differ in summation order only; bf16 (qwen2) rounds attention differently.
TOLERANCE = {"float32": 2e-4, "bfloat16": 0.1}


def random_tree(rng, n):
    """Parents of a random tree of n nodes, or a chain one time in four."""
    if rng.random() < 0.25:
        return list(range(-1, n - 1))
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]


def path_of(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def check_invariance(engine, rng, num_seqs, max_prefix, layers, long_prefix=0):
    vocab = engine.tokenizer.vocab_size
    seqs = []
    for i in range(num_seqs):
        n = int(rng.integers(1, 9))
        prefix_len = long_prefix if i == 0 and long_prefix else int(rng.integers(0, max_prefix + 1))
        seqs.append(
            {
                "prefix": rng.integers(0, vocab, prefix_len).tolist(),
                "tokens": rng.integers(0, vocab, n).tolist(),
                "parents": random_tree(rng, n),
            }
        )
    together = engine.forward_batch(seqs, layers=layers)
    for i, seq in enumerate(seqs):
        (alone,) = engine.forward_batch([seq], layers=layers)
        assert np.array_equal(together[i].logits, alone.logits), f"sequence {i}: logits differ in the batch"
        for tap, (a, b) in enumerate(zip(together[i].hidden_states, alone.hidden_states)):
            assert np.array_equal(a, b), f"sequence {i}: layer {layers[tap]} differs in the batch"
        # Each node equals the last row of its root-to-node path run as a chain.
        node = int(rng.integers(0, len(seq["tokens"])))
        path = path_of(seq["parents"], node)
        chain = {"prefix": seq["prefix"], "tokens": [seq["tokens"][j] for j in path]}
        (as_chain,) = engine.forward_batch([chain], layers=layers)
        assert np.array_equal(alone.logits[node], as_chain.logits[-1]), f"sequence {i}: node {node} vs path {path}"
        for a, b in zip(alone.hidden_states, as_chain.hidden_states):
            assert np.array_equal(a[node], b[-1])


def test_smollm2_rows_are_bitwise_invariant(engine):
    check_invariance(engine, np.random.default_rng(1), num_seqs=12, max_prefix=60, layers=[0, 15, 30, "final_norm"])


def test_gemma3_rows_are_bitwise_invariant_past_the_sliding_window():
    gemma = specrs.Engine("gemma3-270m")
    # One sequence starts 600 tokens in, past the 512-token window of Gemma 3's local layers.
    check_invariance(
        gemma, np.random.default_rng(2), num_seqs=6, max_prefix=40, layers=[2, 9, 15, "final_norm"], long_prefix=600
    )


def test_hidden_states_and_logits_are_the_forward_rows(engine):
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    (hidden,) = engine.hidden_states(ids)
    (batch,) = engine.forward_batch([{"tokens": ids, "logits": "none"}], layers=["final_norm"])
    assert hidden.shape == (len(ids), 576) and batch.logits.shape == (0, engine.tokenizer.vocab_size)
    assert np.array_equal(hidden, batch.hidden_states[0])
    (last,) = engine.forward_batch([{"prefix": ids[:4], "tokens": ids[4:], "logits": "last"}])
    assert np.array_equal(last.logits[0], engine.logits(ids)[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_taps_match_transformers_output_hidden_states(family):
    golden = json.loads((GOLDEN / family / "hidden.json").read_text())
    want = [np.array(h, dtype=np.float32) for h in golden["hidden_states"]]
    num_layers = len(want) - 1
    engine = specrs.Engine(str(GOLDEN / family))
    # transformers' entry i < L is the residual after i blocks, entry L the final norm's output.
    got = engine.hidden_states(golden["input_ids"], layers=list(range(num_layers)) + ["final_norm"])
    for i, (g, w) in enumerate(zip(got, want)):
        scale = float(np.abs(w).max())
        diff = float(np.abs(g - w).max())
        assert diff <= TOLERANCE[golden["dtype"]] * scale, f"{family} tap {i}: max |diff| {diff} at scale {scale}"


def test_bad_batches_are_config_errors(engine):
    cases = [
        ([{"tokens": [1, 2], "parents": [-1, 1]}], ["final_norm"], "parent"),
        ([{"tokens": [1, 2], "parents": [-1]}], [], "parents for 2 tokens"),
        ([{"tokens": []}], [], "no tokens"),
        ([{"tokens": [1], "logits": "some"}], [], "'all', 'last' or 'none'"),
        ([{"tokens": [1, 2], "parents": [-1, 0], "logits": "last"}], [], "a tree has no last row"),
        ([{"tokens": [1], "prefx": [2]}], [], "optionally 'prefix'"),
        ([{"tokens": [1]}], [31], "0..=30"),
        ([{"tokens": [1]}], [-1], "ints >= 0"),
        ([{"tokens": [1]}], ["after_norm"], "'final_norm'"),
        ([{"tokens": [10**6]}], [], "vocabulary"),
        ([], [], "at least one sequence"),
    ]
    for seqs, layers, message in cases:
        with pytest.raises(specrs.ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
            engine.forward_batch(seqs, layers=layers)
    with pytest.raises(specrs.ContextLengthError):
        engine.forward_batch([{"prefix": [1] * 9000, "tokens": [1]}])


ROW_COUNT_MODELS = [str(Path(__file__).parent / "golden" / "gguf" / f"{f}-q8_0.gguf") for f in FAMILIES] + [
    "smollm2-135m",
    "gemma3-270m",
]


@pytest.mark.parametrize("model", ROW_COUNT_MODELS, ids=[f"gguf-{f}" for f in FAMILIES] + ["smollm2", "gemma3"])
def test_every_row_count_computes_each_row_as_alone(model):
    """A forward of n = 1..17 new rows (a verification pass of n - 1 drafts): every row's logits
    equal that token's forward alone after the same context, bitwise, for every family's GGUF
    file and both real models (every kernel the files use: Q8_0, Q4_1, Q5_0, Q4_K, Q6_K)."""
    engine = specrs.Engine(model)
    rng = np.random.default_rng(17)
    vocab = engine.tokenizer.vocab_size
    prefix = rng.integers(0, vocab, 23).tolist()
    tokens = rng.integers(0, vocab, 17).tolist()
    alone = [
        engine.forward_batch([{"prefix": prefix + tokens[:i], "tokens": [tokens[i]]}])[0].logits[0] for i in range(17)
    ]
    for n in range(1, 18):
        (rows,) = engine.forward_batch([{"prefix": prefix, "tokens": tokens[:n]}])
        for i in range(n):
            assert np.array_equal(rows.logits[i], alone[i]), f"{model}: row {i} of {n}"
