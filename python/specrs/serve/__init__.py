"""`specrs serve`: an OpenAI-compatible HTTP server over one Engine.

    specrs serve [MODEL] [--speculative-config JSON] [--max-model-len N] [--host 127.0.0.1] [--port 8000]

Its flags are `vllm serve`'s where they mean the same (MODEL, --speculative-config,
--max-model-len, --served-model-name, --max-num-seqs, --max-num-batched-tokens, --host, --port,
--generation-config, --override-generation-config); an unknown flag is an error.

Routes: POST /v1/completions and /v1/chat/completions (streaming SSE or not), GET /v1/models,
/health (with the queue depth) and /metrics (Prometheus). A request may carry `"speculative"`:
false, or a config object like --speculative-config's (without "method": the server's default with
those keys changed); its `usage` reports that request's acceptance.

`--suffix-cache PATH` keeps suffix decoding's engine-wide cache (the previous responses it drafts
from) across restarts: loaded at startup, written atomically every `--suffix-cache-save-every`
requests (default 100) and at shutdown. A file that cannot be used (corrupt, truncated, from
another model) stops startup unless `--suffix-cache-start-empty-on-error` is given.

`--api-key KEY` (or `SPECRS_API_KEY`): every route but /health requires `Authorization: Bearer KEY`
(/metrics too, unless `--metrics-public`); a request without it gets a 401.

Connections: a client must send its request line and headers within `--header-timeout` seconds
(default 10) and its body within `--body-timeout` seconds after them (default 60), else it gets a
408 and its connection is closed; at most `--max-connections` connections are open at once (default
1000; one more gets a 503 and is closed); an idle keep-alive connection is closed after
`--timeout-keep-alive` seconds (default 5).

Special-token text in chat messages (e.g. "<|im_end|>") is tokenized as plain text, so a client
cannot forge a system or assistant turn; `--allow-special-tokens-in-content` makes it special
tokens, as vLLM does.

Needs the `serve` extra's packages (starlette, uvicorn, prometheus-client, jsonschema), checked
before the model loads (extras.py).
"""

from __future__ import annotations

import os
import sys
import time

from .. import extras
from ..engine import (DEFAULT_CUDA_GRAPH_MEMORY_MB, DEFAULT_DRAFT_BUDGET, DEFAULT_KV_BLOCK_SIZE,
                      DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS)
from ..errors import ConfigError
from . import generation_config as generation
from .auth import resolve_api_key
from .connections import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                          DEFAULT_MAX_CONNECTIONS)
from .protocol import DEFAULT_CHAT_MAX_TOKENS
from .suffix_store import DEFAULT_SAVE_EVERY as DEFAULT_SUFFIX_CACHE_SAVE_EVERY

# Prompt tokens per step while other requests are generating. On the 2-core CI machine a 64-token
# chunk prefills as fast as a whole 769-token prompt did and stalls the other streams for 0.3 s
# instead of 3.7 s (benches/README.md).
DEFAULT_PREFILL_CHUNK = 64
# Request bodies over this are refused with a 413 while they are read. 8 MiB holds a prompt far
# longer than any context specrs serves (a 128k-token prompt is about 0.5-1 MB of text).
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
DRAFT_BUDGETS = ("load", "off")


def _check_settings(max_num_seqs: int, prefill_chunk: int | None, max_request_body_bytes: int,
                    default_max_tokens: int, suffix_cache_save_every: int = DEFAULT_SUFFIX_CACHE_SAVE_EVERY,
                    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, max_kv_tokens: int | None = None,
                    draft_budget: str = DEFAULT_DRAFT_BUDGET, record_traffic: str | None = None,
                    max_model_len: int | None = None) -> None:
    if max_model_len is not None and max_model_len < 1:
        raise ConfigError(f"max_model_len must be at least 1 token, or None for the model's context (got {max_model_len})")
    if max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be at least 1 (got {max_num_seqs})")
    if max_num_batched_tokens < max_num_seqs:
        raise ConfigError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs "
                          f"({max_num_seqs}): every running request needs a row each step")
    if max_kv_tokens is not None and max_kv_tokens < 1:
        raise ConfigError(f"max_kv_tokens must be at least 1 position, or None for no bound (got {max_kv_tokens})")
    if draft_budget not in DRAFT_BUDGETS:
        raise ConfigError(f"draft_budget must be 'load' or 'off' (got {draft_budget!r})")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ConfigError(f"prefill_chunk must be at least 1 token, or None for whole prompts (got {prefill_chunk})")
    if max_request_body_bytes < 1:
        raise ConfigError(f"max_request_body_bytes must be at least 1 (got {max_request_body_bytes})")
    if default_max_tokens < 1:
        raise ConfigError(f"default_max_tokens must be at least 1 token (got {default_max_tokens})")
    if suffix_cache_save_every < 1:
        raise ConfigError(f"suffix_cache_save_every must be at least 1 finished request (got {suffix_cache_save_every})")


def _check_seconds(name: str, value: float | None) -> None:
    if value is not None and not value > 0:  # NaN too
        raise ConfigError(f"{name} must be a positive number of seconds (got {value})")


def _check_connection_settings(header_timeout_s: float, body_timeout_s: float | None, max_connections: int,
                               keep_alive_timeout_s: float) -> None:
    _check_seconds("header_timeout", header_timeout_s)
    _check_seconds("body_timeout", body_timeout_s)
    _check_seconds("timeout_keep_alive", keep_alive_timeout_s)
    if max_connections < 1:
        raise ConfigError(f"max_connections must be at least 1 (got {max_connections})")


def uvicorn_settings(host: str, port: int, log_level: str = "info",
                     header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                     max_connections: int = DEFAULT_MAX_CONNECTIONS,
                     keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S) -> dict:
    """uvicorn's keyword arguments for serving: the address, and the connection limits
    (connections.py) in its HTTP protocol."""
    from .connections import limited_protocol

    _check_connection_settings(header_timeout_s, None, max_connections, keep_alive_timeout_s)
    return {"host": host, "port": port, "log_level": log_level, "timeout_keep_alive": keep_alive_timeout_s,
            "http": limited_protocol(header_timeout_s, max_connections)}


def served_name(model: str | None, model_path: str) -> str:
    """The name clients pass as `model`: the model argument as given (as vLLM does), or the default
    model's file name without its extension."""
    return model if model is not None else os.path.splitext(os.path.basename(model_path))[0]


# The verification curve `serve` queues at startup covers forwards of up to this many rows: the
# draft budget's batch cost curve (the core's BUDGET_CURVE_ROWS; extended along its last slope
# past it), and drafts of up to 31 tokens.
BUDGET_CURVE_ROWS = 32


def build_app(engine, served_model_name: str | None = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
              prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS, suffix_cache: str | os.PathLike[str] | None = None,
              suffix_cache_save_every: int = DEFAULT_SUFFIX_CACHE_SAVE_EVERY,
              suffix_cache_start_empty_on_error: bool = False,
              max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, max_kv_tokens: int | None = None,
              draft_budget: str = DEFAULT_DRAFT_BUDGET, record_traffic: str | os.PathLike[str] | None = None,
              api_key: str | None = None, metrics_public: bool = False,
              body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
              generation_config: str = "auto", override_generation_config: str | dict | None = None):
    """The Starlette app serving `engine` (run it with any ASGI server); `engine.speculative_config`
    and `engine.proposer` are every request's default. `max_request_body_bytes`: larger bodies get
    a 413; `default_max_tokens`: a chat request without max_tokens generates at most this many
    (or up to the end of the context, whichever is smaller). `suffix_cache`: the file the suffix
    cache is loaded from here (ConfigError for a corrupt, truncated or other model's file, unless
    `suffix_cache_start_empty_on_error`) and saved to every `suffix_cache_save_every` finished
    requests and at shutdown. `max_num_seqs`, `max_num_batched_tokens`, `max_kv_tokens`,
    `prefill_chunk` and `draft_budget` set the continuous-batching scheduler (serve/scheduler.py).
    `record_traffic`: a directory where every finished request's prompt and output are stored
    (serve/traffic.py; off by default). `api_key`: every route but /health (and /metrics with
    `metrics_public`) requires `Authorization: Bearer <api_key>` (None: no authentication; the
    environment is not read here, `serve` does). `body_timeout_s`: a request body must arrive
    within this many seconds (408 after; None: no limit). `generation_config` ("auto": the model's
    generation_config.json, "vllm": none, or a directory) and `override_generation_config` give
    the defaults of requests' sampling fields, as vLLM's flags of those names do."""
    extras.require("serve", "specrs serve")
    from .app import build_app as build

    _check_settings(max_num_seqs, prefill_chunk, max_request_body_bytes, default_max_tokens, suffix_cache_save_every,
                    max_num_batched_tokens, max_kv_tokens, draft_budget)
    _check_seconds("body_timeout", body_timeout_s)
    if api_key is not None:
        api_key = resolve_api_key(api_key)  # refuses an empty key
    defaults = generation.load(generation_config, engine.model_path, override_generation_config)
    return build(engine, served_model_name or served_name(None, engine.model_path), max_num_seqs, prefill_chunk,
                 max_request_body_bytes, default_max_tokens,
                 suffix_cache=None if suffix_cache is None else os.fspath(suffix_cache),
                 suffix_cache_save_every=suffix_cache_save_every,
                 suffix_cache_start_empty_on_error=suffix_cache_start_empty_on_error,
                 max_num_batched_tokens=max_num_batched_tokens, max_kv_tokens=max_kv_tokens, draft_budget=draft_budget,
                 record_traffic=None if record_traffic is None else os.fspath(record_traffic), api_key=api_key,
                 metrics_public=metrics_public, body_timeout_s=body_timeout_s, generation_defaults=defaults)


def load_engine(model: str | None, speculative_config, device: str, max_model_len: int | None = None,
                allow_special_tokens_in_content: bool = False, kv_layout: str = "auto",
                kv_block_size: int = DEFAULT_KV_BLOCK_SIZE, max_kv_tokens: int | None = None,
                enforce_eager: bool = False, cuda_graph_memory_mb: int = DEFAULT_CUDA_GRAPH_MEMORY_MB):
    """The engine a server runs: loaded (its context capped at `max_model_len`), warmed up with the
    default speculation (so a bad draft fails now, not at the first request), with the
    verification curves its requests and draft budget read queued for the engine's background
    thread. No cost is measured here: the server starts on the figures its disk cache holds, or
    the prior, and the background thread measures the rest while no request runs. Each wait is
    named in the log. `specrs serve` and each replica of `specrs serve --ray` start with it.
    `allow_special_tokens_in_content`: the engine's setting (`Engine.prompt_token_ids`).
    `kv_layout`, `kv_block_size`: the engine's ("auto": paged on CUDA); a paged pool holds `max_kv_tokens` positions (the
    scheduler's bound; None: one full context), which the scheduler then budgets in blocks.
    `enforce_eager`, `cuda_graph_memory_mb`: whether a paged engine on CUDA captures its steps as
    CUDA graphs, and within what memory (`Engine`)."""
    from .. import _specrs
    from ..engine import Engine, SamplingParams
    from ..log import logger

    if isinstance(kv_layout, str):  # "auto" named for the device, so max_kv_tokens goes where a pool is
        kv_layout = _specrs.resolve_kv_layout(kv_layout, device)
    engine = Engine(model, device=device, speculative_config=speculative_config, max_model_len=max_model_len,
                    allow_special_tokens_in_content=allow_special_tokens_in_content, kv_layout=kv_layout,
                    kv_block_size=kv_block_size, max_kv_tokens=max_kv_tokens if kv_layout == "paged" else None,
                    enforce_eager=enforce_eager, cuda_graph_memory_mb=cuda_graph_memory_mb)
    # One short request through the default speculation runs its proposer once before the first
    # client arrives (the weights themselves were loaded above).
    start_s = time.perf_counter()
    logger.info("warming up: one 4-token request")
    engine.generate(engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=4, temperature=0.0))
    logger.info("warmed up in %.1f s", time.perf_counter() - start_s)
    # Per-request configs read the verification curve (extended past its end), and the draft
    # budget reads the same curve as its batch cost curve, forwards of 1..32 rows: queued for the
    # background thread now, measured before any request if none arrives first, and read from the
    # disk cache by later runs.
    engine.prepare_batch_costs(BUDGET_CURVE_ROWS)
    status = engine.cost_status()
    if status["pending"]:
        logger.info("serving on the cost figures at hand (%s) while measuring in the background: %s",
                    ", ".join(f"{f['what']}: {f['source']}" for f in status["figures"]) or "priors",
                    "; ".join(status["pending"]))
    return engine


def serve(model: str | None = None, *, speculative_config=None, host: str = "127.0.0.1", port: int = 8000,
          device: str = "cpu", served_model_name: str | None = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
          prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
          max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
          default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS, log_level: str = "info",
          suffix_cache: str | None = None, suffix_cache_save_every: int = DEFAULT_SUFFIX_CACHE_SAVE_EVERY,
          suffix_cache_start_empty_on_error: bool = False,
          max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, max_kv_tokens: int | None = None,
          draft_budget: str = DEFAULT_DRAFT_BUDGET, record_traffic: str | None = None, max_model_len: int | None = None,
          generation_config: str = "auto", override_generation_config: str | None = None,
          allow_special_tokens_in_content: bool = False, api_key: str | None = None,
          metrics_public: bool = False, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
          body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS,
          keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S, kv_layout: str = "auto",
          kv_block_size: int = DEFAULT_KV_BLOCK_SIZE, enforce_eager: bool = False,
          cuda_graph_memory_mb: int = DEFAULT_CUDA_GRAPH_MEMORY_MB) -> None:
    """Loads the model (its context capped at `max_model_len` tokens, vLLM's --max-model-len), warms
    it up with the default speculation (so a bad draft fails now, not at the first request), queues
    the cost measurements for the engine's background thread, loads the suffix cache file if one is
    given (a bad one fails now), and serves until interrupted. `allow_special_tokens_in_content`:
    chat messages' special-token text becomes special tokens (vLLM's behaviour) instead of plain
    text (`Engine.prompt_token_ids`). `api_key` None reads `$SPECRS_API_KEY` (still None: no
    authentication). `kv_layout` "paged" (what "auto" is on CUDA): the KV cache is one pool of
    `max_kv_tokens` positions (None: one full context) in blocks of `kv_block_size`; on CUDA its
    steps are captured as CUDA graphs within `cuda_graph_memory_mb` unless `enforce_eager`
    (`load_engine`)."""
    extras.require("serve", "specrs serve")  # before the model loads: minutes, on a big one
    import uvicorn

    _check_settings(max_num_seqs, prefill_chunk, max_request_body_bytes, default_max_tokens, suffix_cache_save_every,
                    max_num_batched_tokens, max_kv_tokens, draft_budget, max_model_len=max_model_len)
    _check_connection_settings(header_timeout_s, body_timeout_s, max_connections, keep_alive_timeout_s)
    api_key = resolve_api_key(api_key)
    engine = load_engine(model, speculative_config, device, max_model_len, allow_special_tokens_in_content,
                         kv_layout, kv_block_size, max_kv_tokens, enforce_eager, cuda_graph_memory_mb)
    name = served_model_name or served_name(model, engine.model_path)
    # The warm-up's response went into the suffix cache; a loaded file replaces it.
    app = build_app(engine, name, max_num_seqs, prefill_chunk, max_request_body_bytes, default_max_tokens,
                    suffix_cache=suffix_cache, suffix_cache_save_every=suffix_cache_save_every,
                    suffix_cache_start_empty_on_error=suffix_cache_start_empty_on_error,
                    max_num_batched_tokens=max_num_batched_tokens, max_kv_tokens=max_kv_tokens,
                    draft_budget=draft_budget, record_traffic=record_traffic, api_key=api_key,
                    metrics_public=metrics_public, body_timeout_s=body_timeout_s,
                    generation_config=generation_config, override_generation_config=override_generation_config)
    spec = engine.speculative_config["method"] if engine.speculative_config else "off"
    auth = "off" if api_key is None else "API key" + (", /metrics public" if metrics_public else "")
    print(f"specrs serve: `{name}` on http://{host}:{port}/v1 (speculation: {spec}, up to {max_num_seqs} "
          f"requests batched per step, draft budget: {draft_budget}, authentication: {auth})", file=sys.stderr,
          flush=True)
    uvicorn.run(app, **uvicorn_settings(host, port, log_level, header_timeout_s, max_connections,
                                        keep_alive_timeout_s))


__all__ = ["build_app", "load_engine", "serve", "served_name", "uvicorn_settings"]
