"""Generators of hostile grammar and JSON inputs (issue 38), shared by the tests: each builds one
shape that once crashed the server (a stack overflow), failed at the first token (a 500), or made
Python recurse past its limit. Every builder is iterative, so building a deep input costs no stack.

The numbers that matter are specrs' limits, read from the engine (`GRAMMAR_LIMITS`), so a test can
build an input just under or just over one.
"""

from __future__ import annotations

from specrs._specrs import GRAMMAR_LIMITS

LIMITS = dict(GRAMMAR_LIMITS)


def ref_chain_schema(n: int, hop: str = "plain", base: str = "#/$defs/") -> dict:
    """A flat schema whose `$defs` chain `n` `$ref`s (d0 -> d1 -> ... -> a string). `hop` wraps each
    `$ref`: "plain" (the definition is the `$ref`), "property" (an object property), "items" (an
    array's items) or "anyOf" (one branch of two). `base` is where the `$defs` are in the document
    the schema ends up in (a tool's parameters sit at "#/properties/arguments/$defs/" of the call
    schema the server compiles for tool_choice "required")."""
    wrap = {
        "plain": lambda ref: ref,
        "property": lambda ref: {"type": "object", "properties": {"a": ref}, "required": ["a"]},
        "items": lambda ref: {"type": "array", "items": ref, "maxItems": 2},
        "anyOf": lambda ref: {"anyOf": [ref, {"type": "null"}]},
    }[hop]
    defs = {f"d{i}": wrap({"$ref": f"{base}d{i + 1}"}) for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": f"{base}d0"}


def deep_ref_chain_schema(n: int = 5000, base: str = "#/$defs/") -> dict:
    """The reported crash: a flat ~178 KB schema (at n = 5000) chaining `n` `$ref`s."""
    return ref_chain_schema(n, base=base)


def ref_alias_cycle_schema(levels: int = 40, aliases: int = 60, base: str = "#/$defs/") -> dict:
    """A small schema (a few KB) that recurses as deep as a long chain: one definition `levels`
    deep whose innermost value refers to itself through `aliases` different `$ref` strings
    ("a/anyOf/0", "a/anyOf/00", ...: the same branch). llguidance compiles each string once, so
    each alias goes `levels` deeper: about levels * aliases levels in all."""
    refs = [{"$ref": f"{base}a/anyOf/{'0' * (i + 1)}"} for i in range(aliases)]
    inner: dict = {"anyOf": refs + [{"type": "null"}]}
    for _ in range(levels):
        inner = {"type": "array", "items": inner, "maxItems": 1}
    return {"$defs": {"a": {"anyOf": [inner]}}, "$ref": f"{base}a/anyOf/0"}


def nested_schema(levels: int) -> dict:
    """Arrays of arrays `levels` deep around a string (JSON nesting levels + 1)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def nested_properties_schema(levels: int) -> dict:
    """Objects whose one property is the next object, `levels` deep (JSON nesting 2 * levels + 1)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def self_ref_schema() -> dict:
    """A schema that is only a `$ref` to itself: it allows no value."""
    return {"$ref": "#"}


def ref_cycle_schema() -> dict:
    """Two definitions that are `$ref`s to each other."""
    return {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def self_containing_schema() -> dict:
    """An object that must contain itself, forever: no finite value."""
    return {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


def self_requiring_behind_a_choice_schema() -> dict:
    """An object that must contain itself, reachable only through a choice (found by the
    grammar_compile fuzz target): the start of the output is fine, the array branch is endless."""
    d3 = {"type": "object", "properties": {"a": {"$ref": "#/$defs/d3"}}, "required": ["a"]}
    return {"$defs": {"d3": d3}, "anyOf": [{"type": "array", "items": {"$ref": "#/$defs/d3"}}, {"type": "null"}]}


def lark_rule_chain(n: int, brackets: int = 0) -> str:
    """A Lark grammar whose rules name the next one, `n` deep, each inside `brackets` groups."""
    lines = ["start: r0"]
    lines += [f"r{i}: {'(' * brackets}r{i + 1}{')' * brackets}" for i in range(n)]
    lines.append(f'r{n}: "x"')
    return "\n".join(lines) + "\n"


def lark_terminal_chain(n: int) -> str:
    """The same chain through terminals."""
    lines = ["start: T0"] + [f"T{i}: T{i + 1}" for i in range(n)] + [f'T{n}: "x"']
    return "\n".join(lines) + "\n"


def regex_repeat(count: int) -> str:
    """`a{count}`."""
    return f"a{{{count}}}"


def nested_regex_repeat(inner: int, outer: int) -> str:
    """`(x{inner}){outer}`: counts that multiply."""
    return f"(x{{{inner}}}){{{outer}}}"


def choices(n: int) -> list[str]:
    """`n` distinct strings with a shared prefix."""
    return [f"c{i:06d}" for i in range(n)]


def deep_json_text(levels: int) -> str:
    """`[[[...]]]` nested `levels` deep, as text."""
    return "[" * levels + "]" * levels


def nested_json_value(levels: int) -> list:
    """`[[[...]]]` nested `levels` deep, as a Python value."""
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


def tool(parameters: dict, name: str = "lookup") -> dict:
    """An OpenAI function tool with these parameters."""
    return {"type": "function", "function": {"name": name, "description": "test tool", "parameters": parameters}}


def assistant_tool_call(arguments: str, name: str = "lookup") -> dict:
    """An earlier assistant turn that called `name` with these arguments (JSON text)."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]}
