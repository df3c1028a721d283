"""Head training (python/specrs/train/, `specrs train-head`) end to end on a tiny target.

A tiny Llama (8 layers, seeded random weights, the golden tiny tokenizer) writes greedy answers to
random prompts; specrs caches its hidden states; an EAGLE-3 head, an MLP speculator and a DFlash
block drafter train for a few epochs with torch. Each must lower its held-out loss AND raise the acceptance specrs itself
measures when it drafts with the written head (greedy, fixed k, against the untrained head of the
same seed), so the trainer, the file format and the engine's head agree. Also: a stopped run
resumes to exactly the weights of an unbroken one, and fine-tuning on a traffic recording raises
the acceptance `specrs advise --held-out` measures on the requests it held out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specrs import Engine, SamplingParams, advise
from specrs.train import dflash, eagle3, features, mlp_speculator
from specrs.train.safetensors import read_safetensors, write_safetensors

ROOT = Path(__file__).resolve().parent.parent
TINY_TOKENIZER = ROOT / "tests" / "golden" / "hf" / "llama"
HIDDEN, LAYERS, VOCAB = 64, 8, 256
K = 3


def write_tiny_llama(out: Path, seed: int = 0) -> Path:
    """A Llama in Hugging Face layout, 8 layers (EAGLE-3 taps 2, 4 and 5), hidden 64, built to
    write learnable text as a trained model does: its blocks are small next to its embedding, and
    its LM head holds the embedding rows permuted, so its greedy next token is mostly pi(current
    token) for a fixed random permutation pi, nudged by the context. A random full-size network
    writes text no few-minute head can predict (checked: acceptance stays near 1/vocab)."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((TINY_TOKENIZER / "config.json").read_text())
    config.update(num_hidden_layers=LAYERS, tie_word_embeddings=False, max_position_embeddings=512)
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY_TOKENIZER / name, out / name)
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    heads, kv, hd, ffn = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]
    embedding = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    pi = rng.permutation(VOCAB)
    lm_head = np.empty_like(embedding)
    lm_head[pi] = embedding  # row pi[t] is e_t: the logit of pi[t] is largest where the state is e_t
    lm_head[config["eos_token_id"]] = 0.0  # greedy text never ends early (advise runs without ignore_eos)
    tensors = {"model.embed_tokens.weight": embedding, "lm_head.weight": lm_head,
               "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
                    p + "self_attn.q_proj.weight": w(heads * hd, HIDDEN), p + "self_attn.k_proj.weight": w(kv * hd, HIDDEN),
                    p + "self_attn.v_proj.weight": w(kv * hd, HIDDEN), p + "self_attn.o_proj.weight": w(HIDDEN, heads * hd),
                    p + "mlp.gate_proj.weight": w(ffn, HIDDEN), p + "mlp.up_proj.weight": w(ffn, HIDDEN),
                    p + "mlp.down_proj.weight": w(HIDDEN, ffn)}
    write_safetensors(str(out / "model.safetensors"), tensors)
    return out


def write_conversations(engine: Engine, path: Path, n: int, seed: int, low: int = 3, high: int = VOCAB) -> Path:
    """n conversations in self-instruct's format: random prompts of tokens in [low, high), the
    target's greedy answers (48 tokens)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(low, high, size=int(rng.integers(6, 30))).tolist() for _ in range(n)]
    results = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), progress=False)
    with open(path, "w") as f:
        for i, (prompt, r) in enumerate(zip(prompts, results)):
            f.write(json.dumps({"index": i, "prompt_ids": prompt, "response_ids": r.token_ids,
                                "finish_reason": r.finish_reason}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    target = write_tiny_llama(d / "target")
    engine = Engine(str(target))
    write_conversations(engine, d / "conversations.jsonl", 160, seed=1)
    index = features.extract(engine, str(d / "conversations.jsonl"), str(d / "features"), shard_tokens=4096)
    assert index["layers"] == [2, 4, 5] and index["num_conversations"] == 160 and len(index["shards"]) > 1
    return {"dir": d, "target": str(target), "engine": engine, "features": str(d / "features")}


EAGLE3_SHAPE = ["--heads", "4", "--kv-heads", "2", "--ffn", "128", "--draft-vocab", "128", "--rope-theta", "10000",
                "--ttt-steps", str(K)]


def train_eagle3(tiny, out: Path, epochs: float, *extra: str) -> dict:
    args = ["--features", tiny["features"], "--target", tiny["target"], "--out", str(out), "--epochs", str(epochs),
            "--lr", "3e-3", "--warmup", "20", "--held-out", "0.1", *EAGLE3_SHAPE, *extra]
    return eagle3.train(eagle3.arguments().parse_args(args))


def specrs_acceptance(engine: Engine, config: dict, prompts: list[list[int]]) -> tuple[float, float]:
    """(acceptance rate, mean acceptance length) over greedy requests of 48 tokens, with their
    outputs checked against plain decoding (a trained head changes the drafts, never the output)."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    accepted = drafted = drafts = 0
    for prompt in prompts:
        r = engine.generate(prompt, params, speculative_config=config)
        assert r.token_ids == engine.generate(prompt, params, speculative_config=False).token_ids
        accepted += r.metrics["num_accepted_tokens"]
        drafted += r.metrics["num_draft_tokens"]
        drafts += r.metrics["num_drafts"]
    return accepted / drafted, 1 + accepted / drafts


def held_out_prompts(tiny) -> list[list[int]]:
    rows = [json.loads(line) for line in open(tiny["dir"] / "conversations.jsonl")]
    return [rows[i]["prompt_ids"] for i in range(0, len(rows), 10)]  # --held-out 0.1: every 10th line


def assert_training_pays(tiny, method: str, untrained: dict, trained: dict, untrained_dir: str, trained_dir: str):
    """Training lowered the held-out loss; specrs measures higher acceptance drafting with the
    trained head than with the untrained one on the held-out prompts; and the trainer's replay of
    greedy drafting over the held-out conversations (the same prompts and greedy answers)
    predicts what specrs measures drafting with the written head."""
    assert trained["held_out"]["loss"] < 0.7 * untrained["held_out"]["loss"]
    config = lambda d: {"method": method, "model": str(tiny["dir"] / d), "num_speculative_tokens": K,  # noqa: E731
                        "adaptive_draft_length": False}
    prompts = held_out_prompts(tiny)
    before, _ = specrs_acceptance(tiny["engine"], config(untrained_dir), prompts)
    after, mean_length = specrs_acceptance(tiny["engine"], config(trained_dir), prompts)
    assert after > before + 0.15, (before, after)
    assert abs(mean_length - trained["held_out"]["mean_acceptance_length"]) < 0.1, (mean_length, trained)


@pytest.fixture(scope="module")
def eagle3_heads(tiny):
    untrained = train_eagle3(tiny, tiny["dir"] / "eagle3-untrained", 0)
    trained = train_eagle3(tiny, tiny["dir"] / "eagle3", 6)
    return untrained, trained


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "fc_norm"])
def eagle3_pair(request, tiny, eagle3_heads):
    """(untrained, trained) reports and their directory names; with fc_norm, speculators' RMSNorm
    per tapped layer before fc (what the shipped Gemma 3 head uses)."""
    if not request.param:
        return (*eagle3_heads, "eagle3-untrained", "eagle3")
    untrained = train_eagle3(tiny, tiny["dir"] / "eagle3-fc-norm-untrained", 0, "--fc-norm")
    trained = train_eagle3(tiny, tiny["dir"] / "eagle3-fc-norm", 6, "--fc-norm")
    return untrained, trained, "eagle3-fc-norm-untrained", "eagle3-fc-norm"


def test_eagle3_training_lowers_loss_and_raises_specrs_acceptance(tiny, eagle3_pair):
    untrained, trained, untrained_dir, trained_dir = eagle3_pair
    assert trained["held_out"]["mean_acceptance_length"] > untrained["held_out"]["mean_acceptance_length"] + 0.3
    assert_training_pays(tiny, "eagle3", untrained, trained, untrained_dir, trained_dir)


def test_mlp_speculator_training_lowers_loss_and_raises_specrs_acceptance(tiny):
    common = ["--features", tiny["features"], "--vocab", str(VOCAB), "--inner", "64", "--n-predict", str(K),
              "--lr", "3e-3", "--warmup", "20", "--held-out", "0.1"]
    run = lambda out, epochs: mlp_speculator.train(mlp_speculator.arguments().parse_args(  # noqa: E731
        [*common, "--out", str(tiny["dir"] / out), "--epochs", str(epochs)]))
    untrained, trained = run("mlp-untrained", 0), run("mlp", 6)
    assert_training_pays(tiny, "mlp_speculator", untrained, trained, "mlp-untrained", "mlp")
    # Tied weights are stored once (what vLLM names for a tied speculator), not per sub-head.
    assert "speculator.emb.1.weight" not in read_safetensors(str(tiny["dir"] / "mlp" / "model.safetensors"))


def test_dflash_training_lowers_loss_and_raises_specrs_acceptance(tiny):
    """A one-layer DFlash drafter with blocks of K + 1 (K drafts per forward), in dflash's format."""
    common = ["--features", tiny["features"], "--target", tiny["target"], "--heads", "4", "--kv-heads", "2",
              "--ffn", "128", "--rope-theta", "10000", "--block-size", str(K + 1), "--lr", "3e-3", "--warmup", "20",
              "--held-out", "0.1"]
    run = lambda out, epochs: dflash.train(dflash.arguments().parse_args(  # noqa: E731
        [*common, "--out", str(tiny["dir"] / out), "--epochs", str(epochs)]))
    untrained, trained = run("dflash-untrained", 0), run("dflash", 6)
    assert_training_pays(tiny, "dflash", untrained, trained, "dflash-untrained", "dflash")


def test_a_stopped_run_resumes_to_the_weights_of_an_unbroken_one(tiny, monkeypatch):
    whole = tiny["dir"] / "resume-whole"
    train_eagle3(tiny, whole, 0.5)
    # The same run, killed at its 50th step; it checkpointed every 20 steps.
    parts = tiny["dir"] / "resume-parts"
    losses, calls = eagle3.losses, []

    def dies_at_step_50(*args):
        calls.append(1)
        if len(calls) == 50:
            raise KeyboardInterrupt
        return losses(*args)

    monkeypatch.setattr(eagle3, "losses", dies_at_step_50)
    with pytest.raises(KeyboardInterrupt):
        train_eagle3(tiny, parts, 0.5, "--save-every", "20")
    monkeypatch.setattr(eagle3, "losses", losses)
    assert torch.load(parts / "checkpoint.pt")["step"] == 40
    train_eagle3(tiny, parts, 0.5, "--save-every", "20")
    a, b = read_safetensors(str(whole / "model.safetensors")), read_safetensors(str(parts / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_fine_tuning_on_recorded_traffic_raises_held_out_acceptance_in_advise(tiny, eagle3_heads):
    """The loop of `specrs serve --record-traffic`, `specrs train-head --init` and `specrs advise
    --held-out`: a head that does not know this traffic yet is fine-tuned on a recording (prompts
    from a 16-token range); on the requests training held out, specrs measures higher acceptance
    with the fine-tuned head than with the one it started from. (The tiny target writes one kind of
    text, which a head learns within an epoch of any of it, so the head it starts from here is the
    untrained one; on real models it is a head trained on other text.)"""
    base = tiny["dir"] / "eagle3-untrained"
    traffic = tiny["dir"] / "traffic"
    traffic.mkdir()
    write_conversations(tiny["engine"], traffic / "traffic.jsonl", 80, seed=7, low=200, high=216)
    features.extract(tiny["engine"], str(traffic / "traffic.jsonl"), str(tiny["dir"] / "traffic-features"))
    tuned = train_eagle3({**tiny, "features": str(tiny["dir"] / "traffic-features")}, tiny["dir"] / "eagle3-tuned", 6,
                         "--init", str(base))
    assert tuned["held_out"]["loss"] < tuned["held_out_before"]["loss"]
    configs = [json.dumps({"method": "eagle3", "model": str(d)}) for d in (base, tiny["dir"] / "eagle3-tuned")]
    report = advise.advise(str(traffic), model=tiny["target"], methods="", configs=configs, max_k=K, max_tokens=48,
                           num_prompts=None, progress=False, held_out=0.1)
    assert report["num_prompts"] == 8  # lines 0, 10, ..., 70: exactly what training held out
    # Acceptance measured at k = max_k with a fixed draft length (the confirm phase's best k and
    # adaptive runs may draft rarely on a target this cheap, where speculation cannot pay).
    before, after = (c["acceptance_rate"] for c in report["candidates"])
    assert after > before + 0.1, (before, after)


def test_features_keep_values_past_float16_range():
    """Gemma 3's residual stream passes float16's 65504: such rows are cached as float32, not inf."""
    small, large = np.full((2, 3), 1.5, np.float32), np.full((2, 3), 1e5, np.float32)
    assert features.compact(small).dtype == np.float16 and np.array_equal(features.compact(small), small)
    assert features.compact(large).dtype == np.float32 and np.array_equal(features.compact(large), large)
