"""Heads that ship with specrs: hidden-state proposers trained here (`specrs train-head`) for the
named models, found by `{"method": "eagle3"}` (or "mlp_speculator", or "auto" with that
"draft_method") with no "model" key, with no path and no download.

A head is trained on one target file's hidden states, so it is matched to the loaded target by
what identifies that file (architecture, vocabulary, depth and weight bytes), not by a name the
user typed: a head never runs on a target it was not trained for. Each head directory here is in
the field's format (speculators' EAGLE-3, IBM's MLP speculator), stored in bfloat16, with a
`training.json` that says how it was trained and what it measured.

Invariant: `with_shipped_head` only ever adds keys: "model", and the head's defaults for keys the
config does not set (`HEAD_METHODS`); a config that names its own head is returned unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .. import _specrs
from ..errors import ConfigError

HEADS_DIR = Path(__file__).parent

# The shipped heads' table is Rust's (`spec_config/shipped.rs`); these are views of it.
_TABLE = _specrs.shipped_heads()
# Per shipped target: what identifies its GGUF file in `Engine.info()`, and its heads by method
# (directories relative to HEADS_DIR).
SHIPPED: dict[str, dict[str, Any]] = _TABLE["targets"]
# Methods whose "model" a shipped head can fill in, and the defaults it runs with (the draft
# length each was trained for; EAGLE-3's heads quantized to Q8_0 at load).
HEAD_METHODS: dict[str, dict[str, Any]] = _TABLE["head_methods"]


def shipped_target(info: Mapping[str, Any]) -> str | None:
    """The name of the shipped target that `info` (`Engine.info()`) describes, or None."""
    for name, entry in SHIPPED.items():
        if all(info.get(key) == value for key, value in entry["match"].items()):
            return name
    return None


def shipped_head(info: Mapping[str, Any], method: str) -> str:
    """Directory of the shipped `method` head for the target `info` describes; ConfigError naming
    what ships when there is none."""
    target = shipped_target(info)
    relative = SHIPPED[target]["heads"].get(method) if target is not None else None
    if relative is None or not (HEADS_DIR / relative / "config.json").is_file():
        shipped = "; ".join(f"{m} for {name}" for name, entry in SHIPPED.items() for m in entry["heads"]
                            if (HEADS_DIR / entry["heads"][m] / "config.json").is_file())
        which = f"the loaded model ({target})" if target else "the loaded model"
        raise ConfigError(
            f"method {method!r} has no \"model\" and no {method} head ships for {which} (specrs ships: "
            f"{shipped or 'none'}); pass \"model\": a head directory, e.g. one written by "
            f"`specrs train-head {method}`")
    return str(HEADS_DIR / relative)


def shipped_heads(info: Mapping[str, Any]) -> dict[str, str]:
    """Directory of every head specrs ships for the target `info` describes, by method."""
    target = shipped_target(info)
    heads = SHIPPED[target]["heads"] if target is not None else {}
    return {method: str(HEADS_DIR / relative) for method, relative in heads.items()
            if (HEADS_DIR / relative / "config.json").is_file()}


def with_shipped_head(config: dict[str, Any], info: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with "model" set to the shipped head when it is a head method without one, and the
    head's defaults (`HEAD_METHODS`) for keys it does not set."""
    method = config.get("method")
    if isinstance(method, str) and method in HEAD_METHODS and "model" not in config:
        defaults = dict(HEAD_METHODS[method])
        if "speculative_token_tree" in config:
            defaults.pop("num_speculative_tokens", None)  # a static tree's size is its node budget
        return {**defaults, **config, "model": shipped_head(info, method)}
    # "auto" with a head among its drafters: the head's weights and quantization, auto's own k.
    drafter = config.get("draft_method")
    if method == "auto" and isinstance(drafter, str) and drafter in HEAD_METHODS and "model" not in config:
        defaults = {key: value for key, value in HEAD_METHODS[drafter].items() if key == "quantization"}
        return {**defaults, **config, "model": shipped_head(info, drafter)}
    return config
