"""The optional packages each command needs, checked before it loads a model.

The wheel depends on numpy only; `specrs serve`, `specrs serve --ray`, the head trainers and
`specrs bench --plot` import more, declared as pyproject.toml's optional dependencies (extras).
Each of those commands calls `require(extra, command)` first, so a missing package is a
ConfigError naming the `pip install` that fixes it, not a ModuleNotFoundError seconds or minutes
later, after the model loaded (or, under Ray, inside a replica).

Invariant: `MODULES[extra]` names every third-party module the code behind that extra imports,
and each one's distribution is in that extra in pyproject.toml (tests/test_extras.py reads both,
and every import in python/specrs, to keep them in step).
"""

from __future__ import annotations

import importlib

from .errors import ConfigError

# Per extra: module imported -> the distribution (as pyproject.toml spells it) that installs it.
SERVE_MODULES = {"starlette": "starlette", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client",
                 "jsonschema": "jsonschema"}
MODULES: dict[str, dict[str, str]] = {
    # `specrs serve`: the HTTP app (starlette on uvicorn), /metrics, tool calls' JSON Schemas.
    "serve": SERVE_MODULES,
    # `specrs serve --ray`: every replica runs the `serve` app.
    "ray": {"ray.serve": "ray", **SERVE_MODULES},
    # `specrs train-head eagle3|mlp_speculator`: torch trains, gguf reads a GGUF target's
    # embedding, tqdm shows progress.
    "train": {"torch": "torch", "gguf": "gguf", "tqdm": "tqdm"},
    # `specrs bench --plot`.
    "plot": {"matplotlib": "matplotlib"},
}


# Distributions whose pip spelling needs an extra of their own.
PIP_SPECS = {"ray": "'ray[serve]'"}


def install_command(extra: str) -> str:
    """The pip command installing `extra`'s packages. It names them rather than `specrs[extra]`:
    specrs is installed from its wheel, not from PyPI, so `pip install 'specrs[serve]'` would look
    for specrs on PyPI (`pip install 'dist/specrs-*.whl[serve]'` works too)."""
    distributions = dict.fromkeys(PIP_SPECS.get(d, d) for d in MODULES[extra].values())
    return f"pip install {' '.join(distributions)}"


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here (imported for real: a package whose own
    dependency is missing counts as missing too)."""
    absent = []
    for module in MODULES[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            absent.append(module)
    return absent


def require(extra: str, command: str) -> None:
    """Raises ConfigError naming the missing modules and the install command when `command` (as the
    user typed it, for the message) cannot run without packages of `extra`."""
    absent = missing(extra)
    if absent:
        raise ConfigError(f"{command} needs {', '.join(absent)}, which this Python lacks: run "
                          f"`{install_command(extra)}`")


__all__ = ["MODULES", "install_command", "missing", "require"]
