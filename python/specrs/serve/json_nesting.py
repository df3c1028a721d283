"""How deeply JSON nests, measured without recursion, and the server's limits on it.

Invariant: the server measures a body, a schema or a tool call's arguments with these before
anything recursive (json.dumps, repr, the JSON Schema validator, Python's parser) runs on it.
"""

from __future__ import annotations

import re

from .._specrs import GRAMMAR_LIMITS

# JSON nesting: the engine's limit for a schema (it owns the number), and for a whole request body
# that plus the levels a request puts around a schema (tools[i].function.parameters: 5). Deeper
# input is refused before anything recursive (json.dumps, repr, the JSON Schema validator) runs on it.
MAX_JSON_NESTING = GRAMMAR_LIMITS["MAX_JSON_NESTING"]
MAX_BODY_NESTING = MAX_JSON_NESTING + 8


def json_nesting_past(value, limit: int) -> int | None:
    """How deep a parsed JSON value nests arrays and objects (`[]` is 1) when that is past `limit`,
    else None. Iterative, so depth costs no stack."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth + 1 > limit:
            return depth + 1
        stack.extend((child, depth + 1) for child in children)
    return None


# A JSON string (or the unterminated rest of one) or a bracket: the tokens that decide nesting.
_JSON_NESTING_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')


def json_text_nesting_past(text: str, limit: int) -> int | None:
    """How deep JSON text nests arrays and objects when that is past `limit`, else None, read
    without parsing it (Python's parser recurses once per level)."""
    depth = 0
    for token in _JSON_NESTING_TOKENS.finditer(text):
        bracket = token.group()
        if bracket in ("[", "{"):
            depth += 1
            if depth > limit:
                return depth
        elif bracket in ("]", "}"):
            depth -= 1
    return None
