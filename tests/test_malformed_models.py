"""Malformed model files are refused at load with a ModelLoadError that names the tensor or key, the
shapes or value, and the fix, before any weight is used; out-of-vocabulary token ids are a
ConfigError on every entry point. Each file is a copy of a tiny golden model (tests/golden/) with
one thing broken, so the unbroken copy loading is the control."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import specrs
from specrs import _specrs

sys.path.insert(0, str(Path(__file__).parent))
from gguf_writer import ALIGNMENT, FLOAT32, STRING, UINT32, GgufModel  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"
Q8_0_ROW = 2 * 34  # a 64-value row of Q8_0: two 34-byte blocks


def golden_gguf(family: str) -> GgufModel:
    return GgufModel.read(GOLDEN / "gguf" / f"{family}-q8_0.gguf")


def write(model: GgufModel, tmp_path, **kwargs) -> str:
    path = tmp_path / "model.gguf"
    model.write(path, **kwargs)
    return str(path)


def test_an_unchanged_copy_loads_and_computes_the_golden_logits(tmp_path):
    # The control: the writer's round trip changes nothing, so each refusal below is its one change.
    engine = specrs.Engine(write(golden_gguf("llama"), tmp_path))
    golden = json.loads((GOLDEN / "gguf" / "llama-q8_0.json").read_text())
    original = specrs.Engine(str(GOLDEN / "gguf" / "llama-q8_0.gguf"))
    np.testing.assert_array_equal(engine.logits(golden["input_ids"]), original.logits(golden["input_ids"]))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_wrong_shape_in_the_last_layer_names_the_tensor_and_both_shapes(tmp_path, family):
    model = golden_gguf(family)
    k = model.tensor("blk.1.attn_k.weight")  # [kv_heads * head_dim = 32 rows of 64]: keep 16 rows
    k.dims, k.data = [64, 16], k.data[: 16 * Q8_0_ROW]
    with pytest.raises(specrs.ModelLoadError, match=r"tensor 'blk\.1\.attn_k\.weight' has shape \[16, 64\], but the "
                       r"metadata implies \[32, 64\].*re-convert"):
        specrs.Engine(write(model, tmp_path))


def test_wrong_ffn_shape_in_the_last_layer(tmp_path):
    model = golden_gguf("phi3")
    up = model.tensor("blk.1.ffn_up.weight")  # fused gate + up: 2 x 128 rows; keep 128
    up.dims, up.data = [64, 128], up.data[: 128 * Q8_0_ROW]
    with pytest.raises(specrs.ModelLoadError, match=r"'blk\.1\.ffn_up\.weight' has shape \[128, 64\].*\[256, 64\]"):
        specrs.Engine(write(model, tmp_path))


@pytest.mark.parametrize("family, tensor", [
    ("qwen2", "blk.1.attn_q.bias"),        # Qwen2 without its biases would run as another model
    ("qwen3", "blk.1.attn_k_norm.weight"),
    ("gemma3", "blk.1.post_ffw_norm.weight"),
    ("llama", "blk.1.ffn_down.weight"),
])
def test_missing_tensor_is_named(tmp_path, family, tensor):
    model = golden_gguf(family)
    model.drop(tensor)
    with pytest.raises(specrs.ModelLoadError, match=rf"has no tensor '{tensor}', which a \w+ model with 2 layers needs"):
        specrs.Engine(write(model, tmp_path))


def test_layers_past_block_count_are_refused(tmp_path):
    model = golden_gguf("llama")
    model.set_int("llama.block_count", 1)  # the file holds 2 blocks
    with pytest.raises(specrs.ModelLoadError, match=r"tensor 'blk\.1\.\w+\.weight' belongs to a layer past the 1 "
                       r"that metadata 'llama\.block_count' gives"):
        specrs.Engine(write(model, tmp_path))


@pytest.mark.parametrize("key, kind, value, match", [
    ("llama.rope.dimension_count", UINT32, 0, r"'llama\.rope\.dimension_count' is 0 rotated dimensions"),
    ("llama.rope.dimension_count", UINT32, 32, r"'llama\.rope\.dimension_count' is 32 rotated.*head dimension 16"),
    ("llama.rope.dimension_count", UINT32, 7, r"'llama\.rope\.dimension_count' is 7 rotated"),
    ("llama.attention.layer_norm_rms_epsilon", FLOAT32, 0.0, r"'llama\.attention\.layer_norm_rms_epsilon' is 0"),
    ("llama.attention.layer_norm_rms_epsilon", FLOAT32, -1e-6, r"layer_norm_rms_epsilon' is -0\.000001"),
    ("llama.rope.freq_base", FLOAT32, float("nan"), r"'llama\.rope\.freq_base' is NaN"),
    ("llama.context_length", UINT32, 0, r"'llama\.context_length' is 0, but it must be in 1\.\.="),
    ("llama.context_length", UINT32, 2**31, r"'llama\.context_length' is 2147483648"),
    ("llama.attention.key_length", UINT32, 0, r"'llama\.attention\.key_length' is 0"),
    ("llama.attention.head_count_kv", UINT32, 3, r"'llama\.attention\.head_count_kv' is 3, which does not divide"),
    ("llama.attention.head_count", UINT32, 0, r"'llama\.attention\.head_count' is 0"),
    ("llama.feed_forward_length", UINT32, 0, r"'llama\.feed_forward_length' is 0"),
])
def test_impossible_metadata_names_key_value_and_fix(tmp_path, key, kind, value, match):
    model = golden_gguf("llama")
    model.metadata[key] = (kind, value)
    with pytest.raises(specrs.ModelLoadError, match=match + r".*re-download the file or re-convert the model"):
        specrs.Engine(write(model, tmp_path))


def test_zero_block_count(tmp_path):
    model = golden_gguf("llama")
    model.set_int("llama.block_count", 0)
    with pytest.raises(specrs.ModelLoadError, match=r"'llama\.block_count' is 0"):
        specrs.Engine(write(model, tmp_path))


def test_tensor_data_past_the_end_of_the_file(tmp_path):
    model = golden_gguf("llama")
    with pytest.raises(specrs.ModelLoadError, match=r"tensor '.+' .*ends past the end of the file.*fetch it again"):
        specrs.Engine(write(model, tmp_path, cut=100))
    # An offset that overflows when added to the data start.
    with pytest.raises(specrs.ModelLoadError, match=r"tensor 'blk\.1\.ffn_down\.weight' .*ends past the end"):
        specrs.Engine(write(model, tmp_path, offsets={"blk.1.ffn_down.weight": 2**64 - 8}))


def test_tensor_size_that_overflows(tmp_path):
    model = golden_gguf("llama")
    # 2^69 values: the element count wraps to 0 in 64 bits, so an unchecked size "fits" any file.
    model.tensor("blk.1.ffn_down.weight").dims = [32, 2**32, 2**32]
    with pytest.raises(specrs.ModelLoadError, match=r"tensor 'blk\.1\.ffn_down\.weight' has shape .* whose size overflows"):
        specrs.Engine(write(model, tmp_path))


def test_rows_that_do_not_split_into_quantization_blocks(tmp_path):
    model = golden_gguf("llama")
    down = model.tensor("blk.1.ffn_down.weight")
    # 64 rows of 48 values: 96 whole Q8_0 blocks in all, but each row ends mid-block.
    down.dims, down.data = [48, 64], down.data[: 48 * 64 // 32 * 34]
    with pytest.raises(specrs.ModelLoadError, match=r"'blk\.1\.ffn_down\.weight' has rows of 48 values, which do not "
                       r"split into Q8_0 blocks of 32"):
        specrs.Engine(write(model, tmp_path))


def test_a_tensor_shifted_off_the_alignment_names_it_and_the_alignment(tmp_path):
    # Issue 38: one byte off, the tensor loaded as garbage weights and the model generated "".
    model = golden_gguf("llama")
    name = "blk.0.attn_q.weight"
    index = next(i for i, t in enumerate(model.tensors) if t.name == name)
    offset = sum(-(-len(t.data) // ALIGNMENT) * ALIGNMENT for t in model.tensors[:index])  # as the writer lays them out
    specrs.Engine(write(model, tmp_path, offsets={name: offset}))  # the control: its own offset loads
    with pytest.raises(specrs.ModelLoadError, match=rf"tensor '{re.escape(name)}' starts at byte {offset + 1} of the "
                       rf"tensor data, which is not a multiple of the file's alignment 32"):
        specrs.Engine(write(model, tmp_path, offsets={name: offset + 1}))


def test_tensors_sharing_bytes_are_refused(tmp_path):
    model = golden_gguf("llama")
    first, second = model.tensors[3].name, model.tensors[4].name
    with pytest.raises(specrs.ModelLoadError, match=rf"tensors '.+' .* and '.+' .* overlap"):
        specrs.Engine(write(model, tmp_path, offsets={second: 0, first: 0}))


# Loops 10^12 times when `condition` holds; the chat template comes from the model file.
LOOPING_TEMPLATE = ("{{% for message in messages %}}{{% if {condition} %}}{{% for i in range(10000) %}}"
                    "{{% for j in range(10000) %}}{{% for k in range(10000) %}}{{{{ '' }}}}{{% endfor %}}{{% endfor %}}"
                    "{{% endfor %}}{{% endif %}}{{{{ message.content }}}}{{% endfor %}}")


def with_chat_template(tmp_path, template: str) -> str:
    model = golden_gguf("llama")
    model.metadata["tokenizer.chat_template"] = (STRING, template)
    return write(model, tmp_path)


def run_isolated(code: str, timeout_s: float = 300) -> str:
    """`code`'s output, run in its own Python: a render that never ends fails the test at the
    timeout instead of hanging the suite (it is not a timing check: the fuel ends it in seconds)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_chat_template_that_loops_on_every_chat_is_refused_at_load(tmp_path):
    # Issue 38: the file loaded, then its first chat request rendered for hours holding a worker.
    path = with_chat_template(tmp_path, LOOPING_TEMPLATE.format(condition="true"))
    out = run_isolated(f"""
import specrs
try:
    engine = specrs.Engine({path!r})
except specrs.ModelLoadError as e:
    print("ModelLoadError:", e)
else:
    engine.prompt_token_ids([{{"role": "user", "content": "hi"}}])
""")
    assert re.search(r"ModelLoadError: the model's chat template \(tokenizer\.chat_template\) did not finish within "
                     r"20000000 steps .* one user message", out), out


def test_a_chat_template_that_loops_on_some_chats_is_a_config_error_for_them(tmp_path):
    path = with_chat_template(tmp_path, LOOPING_TEMPLATE.format(condition="message.content == 'loop'"))
    out = run_isolated(f"""
import specrs
engine = specrs.Engine({path!r})
engine.prompt_token_ids([{{"role": "user", "content": "hi"}}])
try:
    engine.prompt_token_ids([{{"role": "user", "content": "loop"}}])
except specrs.ConfigError as e:
    print("ConfigError:", e)
""")
    assert "ConfigError: the model's chat template did not finish within 20000000 steps" in out, out


# --- Hugging Face directories -------------------------------------------------------------------

def read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    buf = path.read_bytes()
    (n,) = struct.unpack_from("<Q", buf)
    header = json.loads(buf[8:8 + n])
    header.pop("__metadata__", None)
    data = buf[8 + n:]
    return {name: (h["dtype"], h["shape"], data[h["data_offsets"][0]:h["data_offsets"][1]]) for name, h in header.items()}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, data = {}, bytearray()
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data))


def hf_copy(tmp_path, family="llama") -> Path:
    target = tmp_path / family
    shutil.copytree(GOLDEN / "hf" / family, target)
    return target


def test_hf_wrong_shape_in_the_last_layer(tmp_path):
    model = hf_copy(tmp_path)
    tensors = read_safetensors(model / "model.safetensors")
    dtype, shape, raw = tensors["model.layers.1.self_attn.k_proj.weight"]  # [32, 64] f32
    tensors["model.layers.1.self_attn.k_proj.weight"] = (dtype, [16, 64], raw[: 16 * 64 * 4])
    write_safetensors(model / "model.safetensors", tensors)
    with pytest.raises(specrs.ModelLoadError, match=r"tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' has shape "
                       r"\[16, 64\] but config\.json implies \[32, 64\]"):
        specrs.Engine(str(model))


@pytest.mark.parametrize("family, tensor", [
    ("qwen2", "model.layers.1.self_attn.v_proj.bias"),
    ("qwen3", "model.layers.1.self_attn.q_norm.weight"),
    ("gemma3", "model.layers.1.self_attn.k_norm.weight"),
])
def test_hf_missing_bias_or_norm_is_named(tmp_path, family, tensor):
    model = hf_copy(tmp_path, family)
    tensors = read_safetensors(model / "model.safetensors")
    del tensors[tensor]
    write_safetensors(model / "model.safetensors", tensors)
    with pytest.raises(specrs.ModelLoadError, match=rf"tensor '{tensor}' is missing from model\.safetensors"):
        specrs.Engine(str(model))


@pytest.mark.parametrize("key, value, match", [
    ("rms_norm_eps", -1e-6, r"'rms_norm_eps' is -0\.000001, but it must be a positive finite number"),
    ("max_position_embeddings", 0, r"'max_position_embeddings' is 0"),
    ("rope_theta", 0, r"'rope_theta' is 0"),
    ("partial_rotary_factor", 0.0, r"'partial_rotary_factor' is 0 rotated dimensions"),
    ("head_dim", 0, r"'head_dim' is 0"),
])
def test_hf_impossible_config_names_key_value_and_fix(tmp_path, key, value, match):
    model = hf_copy(tmp_path)
    config = json.loads((model / "config.json").read_text())
    config[key] = value
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(specrs.ModelLoadError, match=match + r".*fix config\.json"):
        specrs.Engine(str(model))


def test_hf_sliding_window_of_zero(tmp_path):
    model = hf_copy(tmp_path, "mistral")
    config = json.loads((model / "config.json").read_text())
    config["sliding_window"] = 0
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(specrs.ModelLoadError, match=r"'sliding_window' is 0, but a window must hold"):
        specrs.Engine(str(model))


# --- token ids ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["gguf", "hf"])
def tiny_engine(request):
    """cpu/decoder.rs (GGUF) and candle/decoder.rs (HF directory): the two models behind every device."""
    path = GOLDEN / "gguf" / "llama-q8_0.gguf" if request.param == "gguf" else GOLDEN / "hf" / "llama"
    return specrs.Engine(str(path))


def test_logits_refuse_out_of_vocabulary_ids(tiny_engine):
    vocab = tiny_engine.info()["vocab_size"]
    for ids in ([1, 2, vocab], [vocab + 1000], [2**32 - 1]):
        with pytest.raises(specrs.ConfigError, match=rf"logits\(\): token id {ids[-1]} is outside the vocabulary "
                           rf"\(size {vocab}\)"):
            tiny_engine.logits(ids)
    with pytest.raises(specrs.ConfigError, match="outside the vocabulary"):
        tiny_engine.logits([1, 2, 3, vocab], steps=[2, 2])
    assert tiny_engine.logits([vocab - 1]).shape == (1, vocab)


def test_forward_cost_refuses_out_of_vocabulary_ids(tiny_engine):
    vocab = tiny_engine.info()["vocab_size"]
    with pytest.raises(specrs.ConfigError, match=rf"forward_cost: context token id {vocab} is outside the vocabulary"):
        tiny_engine.forward_cost([5, 6, vocab, 7], [1, 2], repeats=1)
    assert [n for n, _ in tiny_engine.forward_cost([5, 6, vocab - 1, 7], [1, 2], repeats=1)] == [1, 2]


def test_batch_kernels_refuse_bad_ids_and_values_as_config_errors():
    vocab, k = 8, 2
    logits = np.zeros((1, k + 1, vocab), dtype=np.float32)
    uniforms = np.full((1, k + 1), 0.5, dtype=np.float32)
    ok = np.array([[1, 2]], dtype=np.uint32)
    assert _specrs.batch_accept(logits, ok, [2], [0.0], uniforms)[0] == [0]
    with pytest.raises(specrs.ConfigError, match=rf"draft token {vocab} is outside the vocabulary \({vocab}\)"):
        _specrs.batch_accept(logits, np.array([[1, vocab]], dtype=np.uint32), [2], [0.0], uniforms)
    with pytest.raises(specrs.ConfigError, match="temperatures must be finite and >= 0"):
        _specrs.batch_accept(logits, ok, [2], [-1.0], uniforms)
    with pytest.raises(specrs.ConfigError, match=r"uniforms must lie in \[0, 1\)"):
        _specrs.batch_accept(logits, ok, [2], [1.0], np.full((1, k + 1), 1.0, dtype=np.float32))
    with pytest.raises(specrs.ConfigError, match=r"lengths must be <= 4"):
        _specrs.batch_ngram(np.zeros((1, 4), dtype=np.uint32), [5], 1, 2, 2)
