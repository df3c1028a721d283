"""OpenAI tool calling for `specrs serve`: `tools` and `tool_choice` on /v1/chat/completions.

How a request with tools runs:
- The prompt: a chat template that reads `tools` renders them itself; otherwise (SmolLM2's and
  Gemma 3's templates have no tool section) the tools, with the instruction to answer a call as one
  JSON object `{"name": ..., "arguments": {...}}`, go in the system message. Earlier turns in
  OpenAI's form (an assistant message with `tool_calls`, a `tool` message with its result) are
  written as text the template takes: the call's JSON, and a user turn with the result.
- `tool_choice` "required" or a named function: the answer is constrained to the tools' call
  schema (`call_schema`: the name as a constant, the arguments as the function's JSON schema), so
  it always parses and validates; "auto" (the default with tools): the model answers freely, and
  an answer that is exactly a valid call of one tool becomes a tool call (vLLM's auto tool choice
  parses the same way); "none": the tools are not shown and the answer is text.
- Strict: a function's schema is held as written, as OpenAI holds one without `"strict": true`:
  keys it does not declare are allowed unless it says `"additionalProperties": false`. With
  `"strict": true` (OpenAI's Structured Outputs for functions) every object in its parameters
  gets `"additionalProperties": false` where it does not say otherwise (`_closed`), so a call
  carries exactly the declared keys; an object that allows other keys is refused, as OpenAI
  refuses it under strict.
- The answer: `message.tool_calls` with `finish_reason` "tool_calls"; streamed, the call arrives
  as OpenAI's deltas: id, type and name, then the arguments. A constrained call (`CallStream`)
  streams its arguments as they are generated (its form is the grammar's, so the name is known
  once written); an "auto" answer is sent once complete, since only then is it known to be a call.

Invariant: every refusal is an APIError naming the field; a call returned to the client always
validates against its function's parameters.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .errors import APIError
from .json_nesting import MAX_JSON_NESTING, json_nesting_past, json_text_nesting_past

# How a call answer opens, up to the first character of its arguments: `{"name": "<name>", "arguments": `.
CALL_OPENING = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')

TOOL_INSTRUCTION = (
    "You can call these tools (JSON schema of each function's arguments):\n{tools}\n"
    'To call a tool, answer with only a JSON object: {{"name": <tool name>, "arguments": {{...}}}}.'
)


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass
class ToolRequest:
    """What a chat request asked of its tools."""

    tools: list[Tool]
    choice: str  # "auto", "required", or "named"
    named: str | None = None  # the function tool_choice names


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and tool_choice; None when it has none or tool_choice is "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools; send the functions in tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}",
                       param="tools")
    parsed = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"parameters\": {...}}}}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{i}].function.name must be a non-empty string", param="tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        # The validator below recurses (~8 Python frames per level): measure first.
        depth = json_nesting_past(parameters, MAX_JSON_NESTING)
        if depth is not None:
            raise APIError(400, f"tools[{i}].function.parameters nests arrays and objects {depth} or more levels deep, "
                           f"over specrs' limit MAX_JSON_NESTING = {MAX_JSON_NESTING}; flatten the schema (e.g. "
                           "name repeated parts in $defs and use $ref)", param="tools")
        strict = function.get("strict", False)
        if strict is None:
            strict = False
        if not isinstance(strict, bool):
            raise APIError(400, f"tools[{i}].function.strict must be true or false", param="tools")
        if strict:
            parameters = _closed(parameters, f"tools[{i}].function.parameters")
        import jsonschema  # the `serve` extra's; the plain CLI imports this module for serve's flags

        try:
            jsonschema.Draft202012Validator.check_schema(parameters)
        except jsonschema.SchemaError as e:
            raise APIError(400, f"tools[{i}].function.parameters is not a valid JSON schema: {e.message}",
                           param="tools") from None
        parsed.append(Tool(name, str(function.get("description", "")), parameters))
    if len({t.name for t in parsed}) != len(parsed):
        raise APIError(400, "tools has two functions of the same name", param="tools")
    if choice in (None, "auto"):
        return ToolRequest(parsed, "auto")
    if choice == "none":
        return None
    if choice == "required":
        return ToolRequest(parsed, "required")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in {t.name for t in parsed}:
            raise APIError(400, f"tool_choice names the function {str(name)[:80]!r}, which is not in tools",
                           param="tool_choice")
        return ToolRequest(parsed, "named", name)
    raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                   '{"name": ...}}', param="tool_choice")


# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
_ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _closed(schema, where: str):
    """`schema` with `"additionalProperties": false` on every object schema in it that does not
    set it (OpenAI's strict mode); an object that allows other keys is an APIError naming it."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"]) \
        or "properties" in out
    if is_object:
        if "additionalProperties" not in out:
            out["additionalProperties"] = False
        elif out["additionalProperties"] is not False:
            raise APIError(400, f"{where} allows keys it does not declare (additionalProperties), which "
                           "\"strict\": true forbids; drop strict or set additionalProperties to false",
                           param="tools")
    for key in _ONE_SCHEMA:
        if key in out:
            out[key] = _closed(out[key], f"{where}.{key}")
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s, f"{where}.{key}[{j}]") for j, s in enumerate(out[key])]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s, f"{where}.{key}.{name}") for name, s in out[key].items()}
    return out


def call_schema(request: ToolRequest) -> dict | None:
    """The JSON schema a constrained answer must follow (None for "auto")."""
    if request.choice == "auto":
        return None
    tools = [t for t in request.tools if request.choice == "required" or t.name == request.named]
    options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_messages(messages: list[dict], request: ToolRequest | None, template_renders_tools: bool) -> list[dict]:
    """`messages` as the chat template takes them: OpenAI's tool turns written as text, and the
    tools in the system message when the template does not render them."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1 else calls)})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"Tool result: {m['content']}"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if request is None or template_renders_tools:
        return out
    listing = json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters}
                          for t in request.tools])
    instruction = TOOL_INSTRUCTION.format(tools=listing)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + instruction}
    else:
        out.insert(0, {"role": "system", "content": instruction})
    return out


def template_tools(request: ToolRequest | None) -> list[dict] | None:
    """The tools as a chat template reads them (OpenAI's form)."""
    if request is None:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in request.tools]


def parse_call(text: str, request: ToolRequest) -> dict | None:
    """The OpenAI tool call in an answer, or None when the answer is not exactly a valid call."""
    # An answer nested deeper than any accepted schema is no call (and would make json.loads and
    # the validator recurse past Python's limit).
    if json_text_nesting_past(text, MAX_JSON_NESTING + 1) is not None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    tool = next((t for t in request.tools if t.name == value["name"]), None)
    if tool is None or not isinstance(value["arguments"], dict):
        return None
    import jsonschema  # the `serve` extra's (see parse_tools)

    try:
        jsonschema.validate(value["arguments"], tool.parameters)
    except jsonschema.ValidationError:
        return None
    return {"id": _call_id(), "type": "function",
            "function": {"name": tool.name, "arguments": _arguments_text(text, value["arguments"])}}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments_text(text: str, arguments: dict) -> str:
    """The arguments as the model wrote them (what a stream sends), else as JSON text."""
    opening, body = CALL_OPENING.match(text), text.rstrip()
    if opening is not None and body.endswith("}"):
        raw = body[opening.end():-1].rstrip()
        try:
            if json.loads(raw) == arguments:
                return raw
        except ValueError:
            pass
    return json.dumps(arguments)


class CallStream:
    """OpenAI's `tool_calls` deltas of a constrained call ("required" or a named function: the
    grammar holds the answer to `{"name": ..., "arguments": {...}}`) as its text is generated: id,
    type and name once the name is written, then each piece of the arguments. The answer's last
    character is held back until the end, since it may be the call's own closing brace."""

    def __init__(self):
        self.text = ""
        self.arguments_start: int | None = None
        self.sent = 0  # characters of `text` sent

    def feed(self, text: str) -> list[dict]:
        self.text += text
        deltas = []
        if self.arguments_start is None:
            opening = CALL_OPENING.match(self.text)
            if opening is None:
                return []
            self.arguments_start = self.sent = opening.end()
            deltas.append({"index": 0, "id": _call_id(), "type": "function",
                           "function": {"name": json.loads(opening.group(1)), "arguments": ""}})
        return deltas + self._arguments_up_to(len(self.text.rstrip()) - 1)

    def finish(self, complete: bool) -> list[dict]:
        """The rest of the arguments: without the call's closing brace when the answer is
        `complete`, all of it when it was cut (max_tokens)."""
        if self.arguments_start is None:
            return []
        body = self.text.rstrip()
        return self._arguments_up_to(len(body) - 1 if complete and body.endswith("}") else len(self.text))

    @property
    def started(self) -> bool:
        return self.arguments_start is not None

    def _arguments_up_to(self, end: int) -> list[dict]:
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:end], end
        return [{"index": 0, "function": {"arguments": piece}}]
