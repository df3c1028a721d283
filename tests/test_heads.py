"""Hidden-state heads (EAGLE-1, EAGLE-3, MTP, MLP speculator, Medusa, DFlash, DSpark) through the Python API.

- Greedy identity on the real default model with a random head of each kind written in a
  published format (tests/head_writer.py): acceptance is near zero, and every step still equals
  plain greedy decoding; the head's cache rolls back with the target's. A DFlash drafter also on
  Qwen2.5-Coder-0.5B (another family, a 152k vocabulary).
- The sampled distribution with speculation equals plain sampling, with one head of each kind, on
  the tiny Llama target and its golden heads (fast enough for hundreds of seeds).
- Bad heads: each mismatch or unsupported option is a ModelLoadError or ConfigError naming the fix.
The reference-logit tests are in crates/specrs-core/tests/heads_golden.rs."""

import json
import shutil
from pathlib import Path

import pytest
from head_writer import (
    SMOLLM2,
    write_dflash,
    write_dspark,
    write_eagle,
    write_eagle3,
    write_medusa,
    write_mlp_speculator,
    write_mtp_gguf,
)
from test_speculative import PROMPTS, assert_same_distribution, chat, sample_with_and_without

import specrs
from specrs import ConfigError, ModelLoadError, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "heads"
TINY_LLAMA = ROOT / "tests" / "golden" / "hf" / "llama"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """One random SmolLM2-shaped head per method."""
    d = tmp_path_factory.mktemp("heads")
    return {
        "eagle": str(write_eagle(d / "eagle")),
        "eagle3": str(write_eagle3(d / "eagle3")),
        "mtp": str(write_mtp_gguf(d / "mtp.gguf")),
        "mlp_speculator": str(write_mlp_speculator(d / "mlp")),
        "medusa": str(write_medusa(d / "medusa")),
        "dflash": str(write_dflash(d / "dflash", num_layers=2)),
        "dspark": str(write_dspark(d / "dspark")),
    }


def spec(method, model, k, **extra):
    return {"method": method, "model": model, "num_speculative_tokens": k, "adaptive_draft_length": False, **extra}


@pytest.fixture(scope="module")
def baselines(engine):
    return {
        name: engine.generate(chat(text), SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                              speculative_config=False).token_ids
        for name, text in PROMPTS.items()
    }


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "mlp_speculator", "medusa", "dflash", "dspark"])
def test_greedy_identity_with_every_head(engine, baselines, heads, method):
    k = 3
    for name, text in PROMPTS.items():
        stream = engine.stream(chat(text), SamplingParams(temperature=0, max_tokens=MAX_TOKENS), speculative_config=spec(method, heads[method], k))
        for _ in stream:
            target_len, head_len = stream.kv_lens()
            if head_len is not None and method in ("eagle", "eagle3", "mtp", "dflash", "dspark"):
                # The head holds exactly the positions the target read (no draft rows left).
                assert head_len <= target_len
        r = stream.result
        assert r.token_ids == baselines[name], f"{method} diverged on {name}"
        assert r.metrics["num_drafts"] > 0 and r.metrics["spec_method"] == method


@pytest.mark.parametrize("method, quantization", [("eagle3", "q8_0"), ("mtp", "q4_0"), ("medusa", "q8_0")])
def test_greedy_identity_with_quantized_heads(engine, baselines, heads, method, quantization):
    """Head weights quantized at load change only the drafts, never the output."""
    name, text = next(iter(PROMPTS.items()))
    config = {**spec(method, heads[method], 3), "quantization": quantization}
    r = engine.generate(chat(text), SamplingParams(temperature=0, max_tokens=MAX_TOKENS), speculative_config=config)
    assert r.token_ids == baselines[name]
    assert r.metrics["num_drafts"] > 0
    assert engine.memory()["draft_weight_bytes"] > 0


@pytest.mark.parametrize(
    "extra",
    [
        {"adaptive_draft_length": True, "verify_cost_ratios": [1.0, 1.05, 1.1, 1.15], "draft_cost": 0.05},
        {"num_speculative_tokens_schedule": "heuristic"},
        {"draft_confidence_threshold": 0.01},
    ],
)
def test_dynamic_draft_length_with_a_head(engine, baselines, heads, extra):
    name, text = next(iter(PROMPTS.items()))
    config = {**spec("eagle3", heads["eagle3"], 3), **extra}
    r = engine.generate(chat(text), SamplingParams(temperature=0, max_tokens=MAX_TOKENS), speculative_config=config)
    assert r.token_ids == baselines[name]
    assert r.metrics["num_drafts"] > 0


@pytest.mark.parametrize(("method", "unit"), [("eagle3", "token"), ("dflash", "draft")])
def test_head_draft_cost_is_measured_when_prepared(engine, heads, method, unit):
    """The adaptive length's draft cost c for a head is queued at prepare and measured by the
    engine's background thread (a head step after a context whose hidden states it has read), not
    guessed: per token for a recurrent head, per draft for a block drafter (its one forward
    drafts the whole block)."""
    config = {"method": method, "model": heads[method], "num_speculative_tokens": 3}
    engine.prepare(config)
    assert engine.wait_for_costs()
    costs = engine.prepare(config)
    assert costs["draft_cost_source"] in ("measured", "cached")
    assert costs["draft_cost_unit"] == unit
    assert 0.0 < costs["draft_cost"] < 5.0


def test_confidence_threshold_cuts_head_drafts(engine, heads):
    """Heads give probabilities, so the threshold applies: at 0.99 a random head's drafts stop
    after their first token."""
    config = {**spec("eagle", heads["eagle"], 4), "draft_confidence_threshold": 0.99}
    r = engine.generate(chat(PROMPTS["writing"]), SamplingParams(temperature=0, max_tokens=16),
                        speculative_config=config)
    assert r.metrics["num_drafts"] > 0
    assert r.metrics["num_draft_tokens"] == r.metrics["num_drafts"]


GOLDEN_HEADS = {
    "eagle": "eagle_llama",
    "eagle3": "eagle3_llama_speculators",
    "mtp": "mtp_llama_deepseek",
    "mlp_speculator": "mlp_speculator_llama",
    "medusa": "medusa_llama",
    "dflash": "dflash_llama",
    "dspark": "dspark_qwen3",
}


@pytest.mark.parametrize("verification", ["rejection", "coupled"])
@pytest.mark.parametrize("method", list(GOLDEN_HEADS))
def test_sampling_with_a_head_matches_plain_sampling(method, verification):
    """Tokens 2 and 3 (both decided by one k=2 draft) have the same joint distribution with and
    without speculation, with the head's own q in the rejection sampler, or its tokens drawn with
    the target's positional uniforms (coupled)."""
    reference = json.loads((GOLDEN / GOLDEN_HEADS[method] / "reference.json").read_text())
    engine = specrs.Engine(str(ROOT / reference["target"]))
    config = {"method": method, "num_speculative_tokens": 2, "adaptive_draft_length": False,
              "verification": verification}
    if reference["model"]:
        config["model"] = str(ROOT / reference["model"])
    prompt = reference["prompt_ids"]
    params = lambda seed: SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=seed, ignore_eos=True)  # noqa: E731
    n = 600
    plain, speculative, num_drafts = sample_with_and_without(
        engine, prompt, params, n, lambda seed: {"speculative_config": config}
    )
    assert num_drafts >= n
    assert_same_distribution(plain, speculative)


def test_sampled_head_is_seeded(engine, heads):
    config = spec("eagle3", heads["eagle3"], 3)
    run = lambda seed: engine.generate(  # noqa: E731
        chat(PROMPTS["writing"]), SamplingParams(max_tokens=16, temperature=0.8, seed=seed), speculative_config=config
    ).token_ids
    assert run(5) == run(5)


def edited(src: str, dst: Path, **changes) -> str:
    """A copy of the head directory `src` with config.json keys changed (None removes a key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_bad_heads_name_the_fix(engine, heads, tmp_path):
    def refused(error, match, method, model, k=3):
        with pytest.raises(error, match=match):
            engine.generate("hi", SamplingParams(temperature=0, max_tokens=4),
                            speculative_config=spec(method, model, k))

    tiny = dict(SMOLLM2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128)
    # Another target's head: hidden size and vocabulary.
    refused(ModelLoadError, r"hidden size is 576.*trained\s+for another model", "eagle", str(write_eagle(tmp_path / "small", tiny)))
    refused(ModelLoadError, r"vocab_size is 32000.*49152", "eagle", edited(heads["eagle"], tmp_path / "vocab", vocab_size=32000))
    # EAGLE-3: a draft vocabulary without d2t; taps that do not match fc; a tap past the last layer.
    refused(ModelLoadError, r"no 'd2t' tensor", "eagle3", str(write_eagle3(tmp_path / "nod2t", with_d2t=False)))
    refused(ModelLoadError, r"reads 3 tapped hidden states.*taps 2 layers", "eagle3",
            edited(heads["eagle3"], tmp_path / "taps", eagle_aux_hidden_state_layer_ids=[2, 15]))
    refused(ModelLoadError, r"names layer 40.*has 30\s+layers", "eagle3",
            edited(heads["eagle3"], tmp_path / "deep", eagle_aux_hidden_state_layer_ids=[2, 15, 40]))
    refused(ModelLoadError, r"speculators_model_type 'medusa_v9' is not a head specrs reads", "eagle3",
            edited(heads["eagle3"], tmp_path / "kind", speculators_model_type="medusa_v9"))
    refused(ConfigError, r'set "method": "eagle3"', "eagle", heads["eagle3"])
    refused(ConfigError, r"rope_scaling", "eagle", edited(heads["eagle"], tmp_path / "rope", rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    # MTP asked of a model without MTP layers (the default model's own file), or of a head dir without them.
    with pytest.raises(ModelLoadError, match=r"no MTP layers.*eagle3"):
        engine.generate("hi", SamplingParams(temperature=0, max_tokens=4),
                        speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    # Parallel heads draft at most one token per sub-head.
    refused(ConfigError, r"at most 3 tokens.*num_speculative_tokens to at most 3", "medusa", heads["medusa"], k=5)
    # DFlash: another target's drafter, taps past the target's last layer, more drafts than its
    # trained block holds, no mask token, the DFlash2 variant.
    refused(ModelLoadError, r"hidden size is 576.*trained\s+for another model", "dflash",
            str(write_dflash(tmp_path / "dflash_small", tiny)))
    refused(ModelLoadError, r"names layer 30.*has 30\s+layers", "dflash",
            str(write_dflash(tmp_path / "dflash_deep", layer_ids=[2, 30])))
    refused(ModelLoadError, r"reads 2 tapped hidden states.*taps 3 layers", "dflash",
            edited(heads["dflash"], tmp_path / "dflash_taps", dflash_config={
                "block_size": 8, "mask_token_id": 0, "target_layer_ids": [1, 2, 3]}))
    refused(ConfigError, r"at most 7 tokens.*blocks of 8.*num_speculative_tokens to at most 7", "dflash",
            heads["dflash"], k=8)
    refused(ModelLoadError, r"mask_token_id is missing", "dflash",
            edited(heads["dflash"], tmp_path / "dflash_mask", dflash_config={"block_size": 8}))
    refused(ConfigError, r"DFlash2 drafter", "dflash", edited(heads["dflash"], tmp_path / "dflash2", conv_kernel_size=4))
    # DSpark: one named as DFlash, a Gemma 4 drafter, an option specrs does not run, a missing head.
    refused(ConfigError, r'DSpark drafter.*"method": "dspark"', "dflash", heads["dspark"])
    refused(ConfigError, r"model_type 'gemma4'.*Qwen3-family", "dspark",
            edited(heads["dspark"], tmp_path / "dspark_gemma", model_type="gemma4"))
    refused(ConfigError, r"attention_sink_bias is true", "dspark",
            edited(heads["dspark"], tmp_path / "dspark_sinks", attention_sink_bias=True))
    refused(ModelLoadError, r"markov_head.markov_w1.weight", "dspark",
            str(write_dflash(tmp_path / "dflash_as_dspark", layer_ids=[1, 15, 27])))
    refused(ModelLoadError, r"does not exist", "eagle", str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "medusa", "num_speculative_tokens": 3}, r'needs "model"'),  # no medusa head ships
        ({"method": "eagle", "model": "x"}, r"num_speculative_tokens"),
        ({"method": "medusa", "model": "x", "num_speculative_tokens": 2, "exit_layer": 3}, r"exit_layer.*layer_skip"),
    ],
)
def test_bad_head_configs(engine, config, match):
    with pytest.raises(ConfigError, match=match):
        engine.generate("hi", SamplingParams(temperature=0, max_tokens=4), speculative_config=config)


# Qwen2.5-Coder-0.5B's shape (a DFlash drafter's MLP kept small: it is random anyway).
QWEN_05B = dict(hidden=896, heads=14, kv_heads=2, head_dim=64, ffn=1024, vocab=151936, layers=24, rope_theta=1e6)


def test_greedy_identity_with_a_dflash_drafter_on_qwen(tmp_path):
    """A random two-layer DFlash drafter over Qwen2.5-Coder-0.5B (dflash's default taps for 24
    layers): chains of every length its block allows and a tree give plain greedy decoding."""
    engine = specrs.Engine("qwen2.5-coder-0.5b")
    drafter = str(write_dflash(tmp_path / "dflash", QWEN_05B, num_layers=2, block_size=6, mask_token_id=151643))
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = engine.generate(prompt, params, speculative_config=False).token_ids
    for config in (spec("dflash", drafter, 1), spec("dflash", drafter, 5),
                   {**spec("dflash", drafter, 5), "tree": True, "tree_depth": 3, "tree_top_k": 2}):
        r = engine.generate(prompt, params, speculative_config=config)
        assert r.token_ids == plain, config
        assert r.metrics["num_drafts"] > 0
