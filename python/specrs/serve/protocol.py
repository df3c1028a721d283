"""OpenAI request parsing and response bodies for `specrs serve`.

Invariant: every way a request can be wrong ends here as an `APIError` with the HTTP status and
OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`); the message names what to
change. Validation reuses the engine's own (`SamplingParams`, the speculative-config parser), so the
server and the Python API accept and refuse the same things.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engine import METHOD_FACTS, Engine, SamplingParams, SpeculativeConfig, _parse_config
from ..errors import ConfigError, ContextLengthError
from ..heads import shipped_heads
from . import tools as tool_calls
from .errors import MAX_QUOTED_CHARS, APIError, api_error_from
from .json_nesting import MAX_BODY_NESTING, MAX_JSON_NESTING, json_nesting_past, json_text_nesting_past

# OpenAI fields specrs accepts at their default value only: a request that relies on another value
# gets a 400 naming the field rather than a silently different answer.
UNSUPPORTED_UNLESS_DEFAULT = {
    "best_of": 1, "echo": False, "suffix": None, "prompt_logprobs": None,
}
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# Fields that constrain the output to a grammar: OpenAI's response_format and vLLM's (at most one).
GRAMMAR_FIELDS = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_grammar",
                  "guided_choice"}
# vLLM's extra sampling fields (its OpenAI server takes them in the body, `extra_body` in the client).
VLLM_SAMPLING_FIELDS = {"include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                        "truncate_prompt_tokens", "bad_words", "allowed_token_ids"}
COMMON_FIELDS = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
                 "stream_options", "speculative", "ignore_eos", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "logprobs"} | GRAMMAR_FIELDS \
    | VLLM_SAMPLING_FIELDS
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
# OpenAI's limits on alternatives per token: completions' integer `logprobs`, chat's `top_logprobs`.
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
# OpenAI's limit on `n`, samples per request (each a sequence of its own in the batch).
MAX_SAMPLES = 128

# OpenAI's defaults: completions stop after 16 tokens; chat runs to the end of the context, which
# specrs caps at `default_max_tokens` (the server's --default-max-tokens): each request's KV cache
# is allocated for prompt + max_tokens up front, so an uncapped default would reserve the whole
# context for every chat request that leaves max_tokens out.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 2048

# The speculative methods a request may use on any server: they load no weights and need no
# proposer object (`METHOD_FACTS`, Rust's table).
METHODS_WITHOUT_WEIGHTS = [name for name, facts in METHOD_FACTS.items()
                           if not facts["weight_keys"] and not facts["needs_proposer_object"]]

# Integer ranges of the sampling fields (what the engine's SamplingParams takes).
SEED_MAX = 2**64 - 1
TOP_K_MAX = 2**63 - 1


def request_too_large(limit: int, size: str) -> APIError:
    return APIError(413, f"the request body is {size}, over this server's limit of {limit} bytes; send a smaller "
                    "request (the limit is `specrs serve --max-request-body-bytes`)", code="request_too_large")


def parse_json_body(raw: bytes) -> dict:
    too_deep = APIError(400, f"the request body nests JSON arrays or objects too deeply (past {MAX_BODY_NESTING} "
                        f"levels: specrs' limit MAX_JSON_NESTING = {MAX_JSON_NESTING} for a schema, plus the request's "
                        "own levels around it); send flatter JSON")
    try:
        body = json.loads(raw)
    except RecursionError:  # the C parser's own check, far past the limit below
        raise too_deep from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, integer literals over Python's digit limit
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    if json_nesting_past(body, MAX_BODY_NESTING) is not None:
        raise too_deep
    bad = _lone_surrogate(body)
    if bad is not None:
        raise APIError(400, f"the request body holds the string {bad!r} with a lone UTF-16 surrogate (a \\ud800-"
                       "\\udfff escape without its pair), which is not text; send valid Unicode")
    return body


def _lone_surrogate(value) -> str | None:
    """The first string in a parsed JSON value (keys included) that UTF-8 cannot encode: JSON lets
    `\\ud800` stand alone, the tokenizer cannot take it. Iterative, so depth costs no stack."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return v[:40]
    return None


@dataclass
class GenerationRequest:
    """One validated completion or chat request, ready for the scheduler."""

    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    speculative_config: SpeculativeConfig | None  # parsed once, for the engine; None = no speculation
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with only the usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    request_id: str = ""
    created: int = 0
    tools: Any = None  # tools.ToolRequest: the answer may be (or must be) a tool call

    @property
    def logprobs(self) -> bool:
        """Each emitted token's logprobs go in the response."""
        return self.params.logprobs is not None

    @property
    def n(self) -> int:
        """Samples (choices) to return."""
        return self.params.n


@dataclass
class ServerSpeculation:
    """The server's startup speculation, the default of every request.

    A request may use only weights the server holds: its startup config's, or a head specrs ships
    for the loaded model (any quantization of it). Loading anything else per request would stall
    every other stream, keep the weights in memory for good, and let a client probe and parse any
    path on the server; the core says which configs load weights, so no method can be forgotten."""

    config: dict | None  # parsed with every default filled in; None = off
    has_proposer: bool = False  # the engine holds a custom Python proposer
    target_info: dict | None = None  # Engine.info(): a head method without "model" gets the shipped head
    held_weights: list[dict] = field(init=False, default_factory=list)
    shipped: dict[str, str] = field(init=False, default_factory=dict)  # method -> the shipped head's path
    parsed: SpeculativeConfig | None = field(init=False, default=None)  # `config` parsed once

    def __post_init__(self):
        self.parsed = None if self.config is None else SpeculativeConfig.from_json(json.dumps(self.config))
        startup = None if self.parsed is None else self.parsed.weights()
        self.held_weights = [] if startup is None else [startup]
        self.shipped = {} if self.target_info is None else shipped_heads(self.target_info)

    def holds(self, weights: dict) -> bool:
        """Whether `weights` (`SpeculativeConfig.weights()`) are the server's own or a shipped head."""
        shipped = self.shipped.get(weights["method"])
        return weights in self.held_weights or (shipped is not None and shipped == weights.get("model"))

    def for_request(self, value: Any) -> SpeculativeConfig | None:
        """The engine config, parsed once, for a request's `speculative` field: absent, null or
        true = the server's default, false = off, an object = that config (without "method": the
        default's, with these keys changed)."""
        if value is None:
            return self.parsed
        if value is False:
            return None
        if value is True:
            if self.config is None:
                raise APIError(400, "this server has no default speculative config; pass an object such as "
                               '{"method": "ngram", "num_speculative_tokens": 4}', param="speculative")
            return self.parsed
        if not isinstance(value, dict):
            raise APIError(400, 'speculative must be false, null or an object such as {"method": "suffix", '
                           f'"num_speculative_tokens": 6}} (got {type(value).__name__})', param="speculative")
        if "method" not in value:
            if self.config is None:
                raise APIError(400, "speculative has no 'method' and this server has no default speculative "
                               "config to change; add a method, e.g. \"method\": \"ngram\"", param="speculative")
            value = {**self.config, **value}
        try:
            config = _parse_config(value, self.target_info)
        except ConfigError as e:
            raise APIError(400, f"speculative: {e}", param="speculative") from None
        method = config.method
        if METHOD_FACTS[method]["needs_proposer_object"] and not self.has_proposer:
            raise APIError(400, f"speculative method {method!r} needs a Python proposer object, which cannot be sent "
                           "over HTTP; serve it with specrs.serve.build_app(Engine(proposer=...))", param="speculative")
        weights = config.weights()
        if weights is not None and not self.holds(weights):
            # The message never quotes the values: whether a path exists must not show.
            keys = " and ".join(f'"{key}"' for key in weights if key != "method")
            shipped = f" or a head specrs ships (leave \"model\" out: {', '.join(sorted(self.shipped))})" \
                if self.shipped else ""
            raise APIError(
                400, f"speculative method {method!r} with this {keys} loads weights, which this server does only at "
                f"startup; use the server's own (start it with --speculative-config naming them){shipped}, or a "
                f"method without weights ({', '.join(METHODS_WITHOUT_WEIGHTS)})", param="speculative")
        return config


def _shown(value) -> str:
    """A client's value for an error message: at most MAX_QUOTED_CHARS characters, even for a
    4000-digit integer or a megabyte string."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str) and len(value) > MAX_QUOTED_CHARS:
        return repr(value[:MAX_QUOTED_CHARS - 3]) + f"... ({len(value)} characters)"
    if isinstance(value, (list, dict)) and len(value) > MAX_QUOTED_CHARS:  # repr() of it all would be large
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= MAX_QUOTED_CHARS else text[:MAX_QUOTED_CHARS - 3] + "..."


def _number(body: dict, key: str, default, kind=float):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise APIError(400, f"{key} must be {'an integer' if kind is int else 'a number'} (got {_shown(value)})",
                       param=key)
    return value if kind is int else _finite(value, key, key)


def _finite(value: int | float, what: str, param: str) -> float:
    """A JSON number as a float: a JSON integer has no size limit, so float() may overflow; inf and
    nan (Python's JSON reads 1e400 as inf, and takes NaN) are refused too."""
    number = float(value) if isinstance(value, float) or abs(value) < 2**1000 else math.inf
    if not math.isfinite(number):
        raise APIError(400, f"{what} must be a finite number (got {_shown(value)})", param=param)
    return number


def _integer(body: dict, key: str, default: int | None, low: int, high: int, fix: str) -> int | None:
    """An integer field in low..=high (JSON integers are unbounded, the engine's are 64-bit)."""
    value = _number(body, key, default, int)
    if value is not None and not low <= value <= high:
        raise APIError(400, f"{key} must be an integer in {low}..={high} (got {_shown(value)}); {fix}", param=key)
    return value


def _check_fields(body: dict, allowed: set[str]) -> None:
    for key, default in UNSUPPORTED_UNLESS_DEFAULT.items():
        value = body.get(key)
        if value is not None and value != default:
            raise APIError(400, f"{key}={_shown(value)} is not supported by specrs serve; leave it out "
                           f"(or send its default, {default!r})", param=key)
    unknown = sorted(set(body) - allowed - set(UNSUPPORTED_UNLESS_DEFAULT) - IGNORED_FIELDS)
    if unknown:
        named = ", ".join(_shown(key) for key in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5
                                                                 else "")
        raise APIError(400, f"unknown request field(s) {named}; this endpoint takes: {', '.join(sorted(allowed))}",
                       param=unknown[0])


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise APIError(400, "stop must be a non-empty string or a list of at most 4 non-empty strings", param="stop")
    return stops


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{key} must be true or false (got {_shown(value)})", param=key)
    return value


def _strings(body: dict, key: str) -> list[str] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise APIError(400, f"{key} must be a list of strings", param=key)
    return value


def _field_named(message: str, body: dict) -> str | None:
    """The request field an engine message opens with ("allowed_token_ids is empty, ..."), if any."""
    word = re.match(r"\w+", message)
    return word.group(0) if word is not None and word.group(0) in body else None


def _truncated_prompt(engine: Engine, body: dict, prompt_ids: list[int]) -> list[int]:
    """The prompt after vLLM's `truncate_prompt_tokens` (the engine's truncation), before the
    context checks, as vLLM truncates when it tokenizes."""
    key = "truncate_prompt_tokens"
    value = _integer(body, key, None, -1, TOP_K_MAX, "keep the last N >= 1 prompt tokens, or -1 for as many as "
                     "the context holds")
    if value is None:
        return prompt_ids
    try:
        return engine._inner.request_prompt(prompt_ids, SamplingParams(truncate_prompt_tokens=value))
    except ConfigError as e:
        raise APIError(400, str(e), param=key) from None


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                       param="messages")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls") and not m.get("content"):
            out.append({"role": "assistant", "content": "", "tool_calls": _tool_calls(m["tool_calls"], i)})
            continue
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise APIError(400, f"messages[{i}] needs a string 'role' and a 'content'", param="messages")
        content = m["content"]
        if isinstance(content, list):  # content parts: only text parts have a meaning here
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                               "are supported", param="messages")
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's earlier tool calls (OpenAI's form), checked."""
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", ""), str) for c in calls):
        raise APIError(400, f"messages[{i}].tool_calls must be a list of {{\"id\", \"type\": \"function\", "
                       "\"function\": {\"name\", \"arguments\": \"<JSON text>\"}}", param="messages")
    for c in calls:
        arguments = c["function"].get("arguments") or "{}"
        if json_text_nesting_past(arguments, MAX_JSON_NESTING) is not None:
            raise APIError(400, f"messages[{i}].tool_calls: the arguments of {c['function']['name'][:80]!r} nest JSON "
                           f"arrays or objects past specrs' limit MAX_JSON_NESTING = {MAX_JSON_NESTING}; send "
                           "flatter arguments", param="messages")
        try:
            json.loads(arguments)
        except ValueError:
            raise APIError(400, f"messages[{i}].tool_calls: the arguments of {c['function']['name']!r} are not "
                           "JSON text", param="messages") from None
    return calls


def _completion_prompt(engine: Engine, body: dict) -> list[int]:
    prompt = body.get("prompt")
    # OpenAI also takes a batch (a list of prompts); specrs serves one prompt per request.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return engine.prompt_token_ids(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab_size = engine.tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {_shown(bad)} is outside the vocabulary (ids are "
                           f"0..{vocab_size - 1})", param="prompt")
        return list(prompt)
    raise APIError(400, "prompt must be a non-empty string or a non-empty list of token ids (one prompt per "
                   "request; send a batch as separate requests)", param="prompt")


def _grammar(body: dict) -> dict | None:
    """The one grammar a request names, as SamplingParams keywords (`json_schema`, `regex`, ...)."""
    given = [key for key in sorted(GRAMMAR_FIELDS) if body.get(key) is not None]
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object",
                                                                                             "json_schema"):
            raise APIError(400, 'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                           '"json_schema", "json_schema": {"name": ..., "schema": {...}}}', param="response_format")
        if response_format["type"] == "text":
            given.remove("response_format")
    if len(given) > 1:
        raise APIError(400, f"give at most one of {', '.join(given)}: each constrains the whole output",
                       param=given[1])
    if not given:
        return None
    key = given[0]
    value = body[key]
    if key == "response_format":
        if value["type"] == "json_object":
            return {"json_object": True}
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise APIError(400, 'response_format.json_schema must be an object {"name": ..., "schema": {...}, '
                           '"strict": true}', param="response_format")
        # strict or not, the output is held to the schema (what strict promises).
        return {"json_schema": spec.get("schema", {})}
    if key == "structured_outputs":
        names = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                 "json_object": "json_object"}
        if not isinstance(value, dict) or set(value) - set(names) or len([v for v in value.values() if v]) != 1:
            raise APIError(400, "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                           param="structured_outputs")
        (name, inner), = [(k, v) for k, v in value.items() if v]
        return {names[name]: inner}
    return {{"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
             "guided_choice": "choice"}[key]: value}


def _logit_bias(body: dict) -> dict[int, float] | None:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise APIError(400, 'logit_bias must map token ids to biases, e.g. {"1234": -100}', param="logit_bias")
    out = {}
    for key, value in bias.items():
        # JSON keys are strings; int() would also take "+5", " 5" and "5_000", and 5000 digits raise.
        if not (key.isascii() and key.isdigit() and len(key) <= 20):
            raise APIError(400, f"logit_bias key {_shown(key)} is not a token id (a string of digits, e.g. \"1234\")",
                           param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(400, f"logit_bias[{key}] must be a number in [-100, 100] (got {_shown(value)})",
                           param="logit_bias")
        out[int(key)] = _finite(value, f"logit_bias[{key}]", "logit_bias")
    return out


def _token_ids(body: dict, key: str) -> list[int] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise APIError(400, f"{key} must be a list of token ids", param=key)
    # Each generated token is checked against the list: repeats would only make that slower (the
    # engine refuses ids outside the vocabulary, so at most a vocabulary's worth remain).
    return list(dict.fromkeys(value))


def _logprobs(kind: str, body: dict) -> int | None:
    """Alternatives per token for SamplingParams(logprobs=...), None when not asked for. Chat:
    `logprobs` true plus `top_logprobs` 0..=20; completions: `logprobs` 0..=5."""
    if kind == "chat":
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise APIError(400, "logprobs must be true or false in a chat request (alternatives: top_logprobs)",
                           param="logprobs")
        top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, "ask for 0 to 20 alternatives")
        if top is not None and not wanted:
            raise APIError(400, "top_logprobs needs \"logprobs\": true", param="top_logprobs")
        return (top or 0) if wanted else None
    if isinstance(body.get("logprobs"), bool):
        raise APIError(400, "logprobs is an integer (alternatives per token) in a completion request",
                       param="logprobs")
    return _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS, "ask for 0 to 5 alternatives")


# Request fields the engine's SamplingParams checks; each of its errors starts with the field's name.
SAMPLING_FIELDS = {"temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "n"}


def _sampling_field(message: str, kind: str, max_key: str) -> str | None:
    """The request field a SamplingParams error is about, from the name it starts with."""
    match = re.match(r"[a-z_]+", message)
    name = match.group(0) if match else None
    if name == "max_tokens":
        return max_key
    if name == "logprobs":
        return "top_logprobs" if kind == "chat" else "logprobs"
    return name if name in SAMPLING_FIELDS else None


def parse_request(kind: str, body: dict, engine: Engine, served_model_name: str, speculation: ServerSpeculation,
                  default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS) -> GenerationRequest:
    """Validates a /v1/completions (kind "completion") or /v1/chat/completions ("chat") body. It
    tokenizes (and renders chat templates), so the server calls it off the event loop."""
    _check_fields(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
    tool_request = tool_calls.parse_tools(body) if kind == "chat" else None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"model must be a string, the served model's name `{served_model_name}` (got "
                       f"{_shown(model)})", param="model")
    if model is not None and model != served_model_name:
        raise APIError(404, f"the model {_shown(model)} does not exist; this server serves `{served_model_name}` "
                       "(see /v1/models)", param="model", code="model_not_found")

    try:
        if kind == "chat":
            renders_tools = tool_request is not None and engine._inner.chat_template_renders_tools
            messages = tool_calls.tool_messages(_messages(body), tool_request, renders_tools)
            prompt_ids = engine.prompt_token_ids(messages, tool_calls.template_tools(tool_request)
                                                 if renders_tools else None)
        else:
            prompt_ids = _completion_prompt(engine, body)
    except ConfigError as e:
        raise APIError(400, str(e), param="messages" if kind == "chat" else "prompt") from None
    prompt_ids = _truncated_prompt(engine, body, prompt_ids)
    max_key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    # The engine's context check (and its messages); the server only says which field is at fault.
    try:
        engine.check_context(len(prompt_ids))
    except ContextLengthError as e:
        raise api_error_from(e, "messages" if kind == "chat" else "prompt") from None
    if kind == "completion":
        default_max = DEFAULT_COMPLETION_MAX_TOKENS
    else:
        default_max = min(default_max_tokens, engine.info()["context_length"] - len(prompt_ids))
    max_tokens = _number(body, max_key, default_max, int)
    if max_tokens < 1:
        raise APIError(400, f"{max_key} must be at least 1 (got {max_tokens})", param=max_key)
    try:
        # A JSON integer has no size limit; the engine's are 64-bit, and past that any context is.
        engine.check_context(len(prompt_ids), min(max_tokens, 2**64 - 1), max_key)
    except ContextLengthError as e:
        raise api_error_from(e, max_key) from None
    seed = _integer(body, "seed", None, 0, SEED_MAX, "pass a seed that fits in 64 bits")
    n = _integer(body, "n", 1, 1, MAX_SAMPLES, f"ask for 1 to {MAX_SAMPLES} choices")
    top_k = _integer(body, "top_k", 0, -1, TOP_K_MAX, "use -1 or 0 to disable top-k")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(400, "ignore_eos must be true or false", param="ignore_eos")
    logprobs = _logprobs(kind, body)
    grammar = _grammar(body)
    schema = None if tool_request is None else tool_calls.call_schema(tool_request)
    if schema is not None:
        if grammar is not None:
            raise APIError(400, "tool_choice \"required\" or a named function already constrains the answer to "
                           "a tool call; drop the response format", param="tool_choice")
        grammar = {"json_schema": schema}
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            # OpenAI's default temperature is 1: a request without one samples.
            temperature=_number(body, "temperature", 1.0),
            top_k=max(top_k, 0),  # vLLM's -1 = off
            top_p=_number(body, "top_p", 1.0),
            min_p=_number(body, "min_p", 0.0),
            seed=seed,
            ignore_eos=ignore_eos,
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            logit_bias=_logit_bias(body),
            min_tokens=_integer(body, "min_tokens", 0, 0, max_tokens, f"use 0..={max_tokens} (at most max_tokens)"),
            stop_token_ids=_token_ids(body, "stop_token_ids"),
            stop=_stop_strings(body),
            include_stop_str_in_output=_flag(body, "include_stop_str_in_output", False),
            skip_special_tokens=_flag(body, "skip_special_tokens", True),
            spaces_between_special_tokens=_flag(body, "spaces_between_special_tokens", True),
            truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
            bad_words=_strings(body, "bad_words"),
            allowed_token_ids=_token_ids(body, "allowed_token_ids"),
            logprobs=logprobs,
            n=n,
            **(grammar or {}),
        )
        engine.check_params(params)  # compiles the grammar: a bad one is a 400 before any answer
    except (ConfigError, TypeError, ValueError) as e:  # TypeError: a grammar field of the wrong type
        grammar_field = next((k for k in sorted(GRAMMAR_FIELDS) if body.get(k) is not None),
                             "tools" if schema is not None else None)
        param = (_sampling_field(str(e), kind, max_key) or _field_named(str(e), body)
                 or (grammar_field if grammar is not None else None))
        raise APIError(400, str(e), param=param) from None

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if (not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}
            or not all(isinstance(v, bool) or v is None for v in options.values())):
        raise APIError(400, 'stream_options takes {"include_usage": true|false, "continuous_usage_stats": true|false}',
                       param="stream_options")
    if options and not stream:
        raise APIError(400, "stream_options needs \"stream\": true", param="stream_options")
    include_usage, continuous_usage = bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))
    if continuous_usage and not include_usage:
        # vLLM reports continuous usage only with include_usage; refuse rather than ignore it.
        raise APIError(400, 'stream_options.continuous_usage_stats needs "include_usage": true as well',
                       param="stream_options")

    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return GenerationRequest(
        kind=kind,
        model=served_model_name,
        prompt_ids=prompt_ids,
        params=params,
        speculative_config=speculation.for_request(body.get("speculative")),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        tools=tool_request,
    )


# ---------------------------------------------------------------------------------------------
# Response bodies


def usage(num_prompt_tokens: int, num_completion_tokens: int, metrics: dict | None) -> dict:
    """OpenAI's token counts plus this request's acceptance (`speculative`, null without it)."""
    out = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
           "total_tokens": num_prompt_tokens + num_completion_tokens, "speculative": None}
    if metrics and metrics.get("spec_method"):
        out["speculative"] = {"method": metrics["spec_method"]} | {key: metrics[key] for key in (
            "num_speculative_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
            "num_accepted_tokens_per_pos", "acceptance_rate", "acceptance_rate_per_pos", "mean_acceptance_length",
            "num_idle_steps", "idle_steps", "idle_reason", "drafters")}
    return out


def merged_metrics(samples: list[dict]) -> dict | None:
    """One request's acceptance from its samples' metrics (n > 1): the counts summed, the rates
    recomputed from the sums as the engine defines them."""
    samples = [m for m in samples if m and m.get("spec_method")]
    if len(samples) <= 1:
        return samples[0] if samples else None
    num_drafts = sum(m["num_drafts"] for m in samples)
    num_draft_tokens = sum(m["num_draft_tokens"] for m in samples)
    num_accepted = sum(m["num_accepted_tokens"] for m in samples)
    width = max(len(m["num_accepted_tokens_per_pos"]) for m in samples)
    per_pos = [sum(m["num_accepted_tokens_per_pos"][i] for m in samples if i < len(m["num_accepted_tokens_per_pos"]))
               for i in range(width)]
    return {
        "spec_method": samples[0]["spec_method"],
        "num_speculative_tokens": max(m["num_speculative_tokens"] for m in samples),
        "num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens, "num_accepted_tokens": num_accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
        "acceptance_rate_per_pos": [count / num_drafts if num_drafts else 0.0 for count in per_pos],
        "mean_acceptance_length": 1.0 + num_accepted / num_drafts if num_drafts else 1.0,
        "num_idle_steps": sum(m["num_idle_steps"] for m in samples),
        "idle_steps": {reason: sum(m["idle_steps"][reason] for m in samples) for reason in samples[0]["idle_steps"]},
        # The sample that stood idle most says why.
        "idle_reason": max(samples, key=lambda m: m["num_idle_steps"])["idle_reason"],
        # "auto": each drafter's counts summed over the samples.
        "drafters": {drafter: {key: sum(m["drafters"][drafter][key] for m in samples) for key in counts}
                     for drafter, counts in samples[0]["drafters"].items()},
    }


def logprobs_body(request: GenerationRequest, entries: list[dict] | None, decode, text_offset: int = 0) -> dict | None:
    """OpenAI's `logprobs` of a choice from the engine's entries (`{"token_id", "logprob",
    "top_logprobs"}`): chat's `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}` or
    completions' `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`. `decode` turns one
    token id into its text."""
    if not request.logprobs or entries is None:
        return None
    if request.kind == "chat":
        def item(token_id, logprob):
            token = decode(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
        return {"content": [item(e["token_id"], e["logprob"]) | {"top_logprobs": [item(t, lp) for t, lp in
                                                                                  e["top_logprobs"]]}
                            for e in entries]}
    tokens = [decode(e["token_id"]) for e in entries]
    offsets, at = [], text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{decode(t): lp for t, lp in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _choice(request: GenerationRequest, index: int, text: str | None, finish_reason: str | None, delta: bool,
            first: bool = False, logprobs: dict | None = None, tool_call: dict | None = None,
            stop_reason: str | int | None = None) -> dict:
    """One choice; `stop_reason` is vLLM's (the stop string or stop token id that ended it)."""
    if request.kind == "completion":
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}
    if not delta:
        message = {"role": "assistant", "content": text}
        if tool_call is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}
    content = {} if text is None else {"content": text}
    if tool_call is not None:
        content = {"tool_calls": [tool_call]}
    return {"index": index, "delta": ({"role": "assistant"} if first else {}) | content, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def answer_choice(request: GenerationRequest, index: int, text: str, finish_reason: str | None,
                  logprobs: dict | None = None, tool_call: dict | None = None,
                  stop_reason: str | int | None = None) -> dict:
    """One sample's choice of a whole (non-streamed) response; with `tool_call`, the answer is that call."""
    return _choice(request, index, text, finish_reason, delta=False, logprobs=logprobs, tool_call=tool_call,
                   stop_reason=stop_reason)


def response_body(request: GenerationRequest, choices: list[dict], usage_: dict) -> dict:
    """The whole (non-streamed) response: `answer_choice` per sample, in index order."""
    return {
        "id": request.request_id,
        "object": "chat.completion" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": choices,
        "usage": usage_,
    }


def chunk_body(request: GenerationRequest, text: str | None, finish_reason: str | None = None,
               usage_: dict | None = None, first: bool = False, no_choices: bool = False,
               logprobs: dict | None = None, tool_call: dict | None = None, index: int = 0,
               stop_reason: str | int | None = None) -> dict:
    """One streamed chunk of sample `index`; `no_choices` makes stream_options.include_usage's
    last chunk; `tool_call` is a delta of OpenAI's `tool_calls`."""
    body = {
        "id": request.request_id,
        "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": [] if no_choices else [_choice(request, index, text, finish_reason, delta=True, first=first,
                                                  logprobs=logprobs, tool_call=tool_call, stop_reason=stop_reason)],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body
