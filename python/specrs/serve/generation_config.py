"""vLLM's `--generation-config` and `--override-generation-config` for `specrs serve`: request
defaults from a model's `generation_config.json`.

`--generation-config auto` (the default, as in vLLM) reads `generation_config.json` beside the
model (a Hugging Face directory has one; a GGUF file has none, so nothing changes); `vllm` reads
nothing; any other value is a directory holding the file. `--override-generation-config JSON`
sets or replaces fields on top. The fields vLLM takes are the ones used: `temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty`, and `max_new_tokens` (a request's default `max_tokens`).
A request's own value always wins; the rest of the file (`do_sample`, token ids) is ignored, as
vLLM ignores it.

Invariant: defaults are filled in before the request is parsed, so a default goes through the same
checks as a value the client sent (a bad file is refused at startup, though: see `load`).
"""

from __future__ import annotations

import json
import os

from ..errors import ConfigError

# generation_config.json field -> request field.
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
SOURCES = ("auto", "vllm")


def load(source: str, model_path: str | None, overrides: str | dict | None = None) -> dict:
    """The request defaults for `--generation-config SOURCE` and `--override-generation-config`."""
    if source == "vllm":
        directory = None
    elif source == "auto":  # only a Hugging Face directory carries the model's own file
        directory = model_path if model_path and os.path.isdir(model_path) else None
    elif os.path.isfile(os.path.join(source, "generation_config.json")):
        directory = source
    else:
        raise ConfigError(f"--generation-config {source!r} is neither 'auto', 'vllm' nor a directory holding "
                          "generation_config.json")
    fields: dict = {}
    path = os.path.join(directory, "generation_config.json") if directory else None
    if path and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                fields = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {path} ({e}); fix it or pass --generation-config vllm") from None
        if not isinstance(fields, dict):
            raise ConfigError(f"{path} is not a JSON object; fix it or pass --generation-config vllm")
    if overrides is not None:
        extra = overrides
        if isinstance(overrides, str):
            try:
                extra = json.loads(overrides)
            except ValueError as e:
                raise ConfigError(f"--override-generation-config is not JSON ({e}); e.g. "
                                  "'{\"temperature\": 0.5, \"max_new_tokens\": 256}'") from None
        if not isinstance(extra, dict) or not set(extra) <= set(FIELDS):
            raise ConfigError(f"--override-generation-config takes an object of {', '.join(FIELDS)} "
                              f"(got {overrides!r})")
        fields = {**fields, **extra}
    defaults = {}
    for key, value in fields.items():
        if key not in FIELDS or value is None:
            continue
        whole = key in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            raise ConfigError(f"generation config field {key} must be {'an integer' if whole else 'a number'} "
                              f"(got {value!r}); fix it or pass --generation-config vllm")
        defaults[FIELDS[key]] = value
    return defaults


def with_defaults(body: dict, defaults: dict) -> dict:
    """`body` with the defaults it does not set (a request with `max_completion_tokens` keeps it)."""
    if not defaults:
        return body
    filled = {key: value for key, value in defaults.items() if body.get(key) is None}
    if "max_tokens" in filled and body.get("max_completion_tokens") is not None:
        del filled["max_tokens"]
    return {**body, **filled}
