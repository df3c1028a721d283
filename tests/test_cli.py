"""The `specrs` command line as `vllm serve` users type it: `--version`, unknown flags refused
(never taken as the positional MODEL), `--max-model-len`, stage usage lines and `--help` of the
trainers without torch, and errors that say what to change (`generate --chat` on a base model)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import specrs

# Runs the CLI with torch made unimportable (`import torch` raises ImportError), as on a machine
# without the train extra.
WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; from specrs.cli import main; sys.exit(main(sys.argv[1:]))"


def specrs_cli(*args: str, without_torch: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", WITHOUT_TORCH] if without_torch else [sys.executable, "-m", "specrs.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout)


def test_version():
    out = specrs_cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"specrs {specrs.__version__}"


@pytest.mark.parametrize("args, unknown", [
    (["serve", "--max-model-lenn", "2048"], "--max-model-lenn"),          # a misspelt flag with a value
    (["serve", "--tensor-parallel-size", "1"], "--tensor-parallel-size"),  # a vLLM flag specrs does not have
    (["serve", "--no-such-flag"], "--no-such-flag"),
    (["generate", "--prompt", "hi", "--no-such-flag", "1"], "--no-such-flag"),
    (["models", "--no-such-flag"], "--no-such-flag"),
])
def test_an_unknown_flag_is_an_error_not_a_positional(args, unknown):
    out = specrs_cli(*args, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert f"unrecognized arguments: {unknown}" in out.stderr, out.stderr
    # Nothing was loaded or served: the error comes from the parser, before any model.
    assert "model not found" not in out.stderr and "Traceback" not in out.stderr


def test_max_model_len_is_a_serve_flag_not_the_model():
    from specrs.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-model-len", "2048"])
    assert (args.model, args.max_model_len) == (None, 2048)
    args = build_parser().parse_args(["serve", "gemma3-270m", "--max-model-len=512", "--served-model-name", "g"])
    assert (args.model, args.max_model_len, args.served_model_name) == ("gemma3-270m", 512, "g")


@pytest.mark.parametrize("stage", ["eagle3", "mlp_speculator"])
def test_trainer_help_works_without_torch(stage):
    out = specrs_cli("train-head", stage, "--help", without_torch=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: specrs train-head {stage} [-h] --features FEATURES --out OUT"), out.stdout
    assert "--epochs" in out.stdout and "needs torch" not in out.stdout + out.stderr


def test_a_trainer_without_torch_checks_its_flags_then_names_the_extra(tmp_path):
    missing = specrs_cli("train-head", "eagle3", "--out", str(tmp_path), without_torch=True, timeout=60)
    assert missing.returncode == 2 and "the following arguments are required: --features" in missing.stderr
    out = specrs_cli("train-head", "eagle3", "--features", str(tmp_path), "--out", str(tmp_path), "--target",
                     "x.gguf", without_torch=True, timeout=60)
    assert out.returncode == 2
    assert "specrs train-head eagle3 needs torch" in out.stderr and "pip install torch gguf tqdm" in out.stderr, \
        out.stderr


@pytest.mark.parametrize("stage", ["data", "features", "eagle3", "mlp_speculator", "ship"])
def test_stage_usage_lines_name_the_stage(stage):
    out = specrs_cli("train-head", stage, "--help", timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: specrs train-head {stage} [-h]"), out.stdout.splitlines()[0]


def test_chat_on_a_model_without_a_template_says_drop_chat():
    out = specrs_cli("generate", "--chat", "--prompt", "Hello", "--model", "gemma3-270m", "--max-tokens", "4")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "gemma3-270m has no chat template (a base model): drop --chat" in out.stderr, out.stderr
    assert "plain string" not in out.stderr


def test_engine_info_says_whether_there_is_a_chat_template(engine):
    assert engine.info()["has_chat_template"] is True
