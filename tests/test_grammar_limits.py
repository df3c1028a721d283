"""Grammar and JSON limits through `specrs serve` and the Python API (issue 38, "Hardening III").

Each input below once killed the server (a stack overflow while compiling its grammar), failed at
the first token with a 500, or made Python recurse past its limit (a 500). Now each is a 400 whose
message names the limit (specrs' constant, e.g. MAX_SCHEMA_DEPTH) and whose `param` names the
field, and the server then answers the next request normally. The inputs come from
`attack_inputs.py`; the limits from the engine (`specrs._specrs.GRAMMAR_LIMITS`).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import specrs
from attack_inputs import (LIMITS, assistant_tool_call, choices, deep_json_text, deep_ref_chain_schema,
                           lark_rule_chain, lark_terminal_chain, nested_json_value, nested_regex_repeat,
                           nested_schema, ref_alias_cycle_schema, ref_chain_schema, ref_cycle_schema, regex_repeat,
                           self_containing_schema, self_ref_schema, self_requiring_behind_a_choice_schema, tool)

uvicorn = pytest.importorskip("uvicorn")
from specrs.serve import build_app  # noqa: E402  (needs the serve extra, checked above)
from test_serve_abuse import serve_in_thread  # noqa: E402

MODEL = "limits-model"
BODY_LIMIT = 4 << 20
CHAT = "/v1/chat/completions"
MAX_JSON_NESTING = LIMITS["MAX_JSON_NESTING"]


@pytest.fixture(scope="module")
def live(engine):
    app = build_app(engine, MODEL, max_num_seqs=2, max_request_body_bytes=BODY_LIMIT, default_max_tokens=4)
    with serve_in_thread(app) as (base, _, _):
        yield base


def _chat(prompt: str = "Say hi.", max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def _post(base: str, body) -> httpx.Response:
    raw = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{base}{CHAT}", content=raw, headers={"Content-Type": "application/json"}, timeout=300)


def _refused(base: str, body, limit: str, param: str | None) -> str:
    """The 400 for `body` names `limit` and `param`; the server then answers a plain request."""
    response = _post(base, body)
    assert response.status_code == 400, response.text[:2000]
    error = response.json()["error"]
    assert limit in error["message"] and error["param"] == param, error
    after = _post(base, _chat())
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"], after.text
    return error["message"]


def _json_schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


CHAIN = deep_ref_chain_schema(5000)
LARK_CHAIN = lark_rule_chain(5000)

# (name, request fields, the limit the message names, the param)
CASES = [
    ("response_format $ref chain", {"response_format": _json_schema(CHAIN)}, "MAX_SCHEMA_DEPTH", "response_format"),
    ("guided_json $ref chain", {"guided_json": CHAIN}, "MAX_SCHEMA_DEPTH", "guided_json"),
    ("structured_outputs $ref chain", {"structured_outputs": {"json": CHAIN}}, "MAX_SCHEMA_DEPTH",
     "structured_outputs"),
    ("$ref chain through property hops", {"guided_json": ref_chain_schema(2000, "property")}, "MAX_SCHEMA_DEPTH",
     "guided_json"),
    ("guided_grammar rule chain", {"guided_grammar": LARK_CHAIN}, "MAX_LARK_DEPTH", "guided_grammar"),
    ("guided_grammar 3,000-rule chain", {"guided_grammar": lark_rule_chain(3000)}, "MAX_LARK_DEPTH",
     "guided_grammar"),
    ("structured_outputs terminal chain", {"structured_outputs": {"grammar": lark_terminal_chain(5000)}},
     "MAX_LARK_DEPTH", "structured_outputs"),
    # A tool's parameters are in the prompt too, so a long chain is past the context first: this
    # one recurses as deep in a few KB (its $defs sit under the call schema's arguments).
    ("tool schema $ref aliases", {"tools": [tool(ref_alias_cycle_schema(base="#/properties/arguments/$defs/"))],
                                  "tool_choice": "required"}, "MAX_SCHEMA_DEPTH", "tools"),
    ("$ref aliases", {"guided_json": ref_alias_cycle_schema()}, "MAX_SCHEMA_DEPTH", "guided_json"),
    ("regex a{1000000}", {"guided_regex": regex_repeat(1_000_000)}, "MAX_REGEX_REPEAT", "guided_regex"),
    ("regex (x{1000}){1000}", {"guided_regex": nested_regex_repeat(1000, 1000)}, "MAX_REGEX_REPEAT", "guided_regex"),
    ("pattern a{1000000}", {"guided_json": {"type": "string", "pattern": "^a{1000000}$"}}, "MAX_REGEX_REPEAT",
     "guided_json"),
    ("choice of 20,000", {"guided_choice": choices(20_000)}, "MAX_CHOICES", "guided_choice"),
    ("$ref to itself", {"response_format": _json_schema(self_ref_schema())}, "no finite instance", "response_format"),
    ("$ref cycle", {"guided_json": ref_cycle_schema()}, "no finite instance", "guided_json"),
    ("object containing itself", {"guided_json": self_containing_schema()}, "no finite instance", "guided_json"),
    # Found by the grammar_compile fuzz target: compiled (its start is fine), then an internal error
    # mid-output once the output took the branch (a 500).
    ("object requiring itself behind a choice", {"guided_json": self_requiring_behind_a_choice_schema()},
     "no finite instance", "guided_json"),
    # Found by the grammar_compile fuzz target: compiled, then an internal error mid-output (a 500).
    ("%ignore beside a %json grammar", {"guided_grammar": 'start: "bab" r1\nr1: %json {"type": "object"} | "end"\n'
                                                          '%ignore /[ \\t]+/\n'}, "%ignore", "guided_grammar"),
    # Found by the grammar_compile fuzz target: a rule that derives only itself, reachable after a
    # nested %lark block, compiled; after "x" the mask failed mid-output (a 500).
    ("rule that never ends", {"guided_grammar": 'start: r0\nr0: %lark {\nstart: r0\nr0: "x"\n} r1 r0 | "end"\n'
                                                'r1: r1\n'}, "never ends", "guided_grammar"),
    ("schema one level too deep", {"guided_json": nested_schema(MAX_JSON_NESTING)}, "MAX_JSON_NESTING",
     "guided_json"),
    ("tool schema one level too deep", {"tools": [tool(nested_schema(MAX_JSON_NESTING))]}, "MAX_JSON_NESTING",
     "tools"),
]


@pytest.mark.parametrize("fields,limit,param", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_each_shape_is_a_400_naming_the_limit(live, fields, limit, param):
    _refused(live, _chat(**fields), limit, param)


def test_a_grammar_past_llguidances_row_limit_mid_output_is_a_400(live, engine):
    """Found by the grammar_compile fuzz target: rules each of which may end where the next starts
    compile (the first row is small), then all complete at once after the first word, past
    llguidance's 2,000 items per parser row. That is the request's error (a 400 naming the limit),
    not a 500, and the server goes on serving."""
    lark = 'start: r0 "!"\n' + "".join(f'r{i}: r{i + 1} | "end"\n' for i in range(1200)) + 'r1200: "x"\n'
    # "end" completes every rule at once ("x" only the last, then each once); bias the model to it.
    (end,) = engine.tokenizer.encode("end")
    response = _post(live, _chat(max_tokens=8, guided_grammar=lark, logit_bias={str(end): 100}))
    assert response.status_code == 400, response.text[:2000]
    message = response.json()["error"]["message"]
    assert "went past a limit of llguidance's parser" in message and "items; max is" in message, message
    after = _post(live, _chat())
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"], after.text


def test_a_matcher_step_without_end_is_a_400_at_the_call_budget_and_others_are_served(live, engine):
    """Found by the grammar_compile fuzz target: two greedy terminals back to back, the first of
    which swallows what the second needs, made one llguidance call force bytes for ever, which
    would have held every request's step. Behind a choice it compiles; once the output takes that
    branch, the call is cancelled at MATCHER_CALL_BUDGET (10 s) and the request is a 400, while a
    request beside it is served."""
    lark = 'start: "a" | "c" r0\nr0: /b+b+/ /b+b+/\n'
    (c,) = engine.tokenizer.encode("c")
    with ThreadPoolExecutor(2) as pool:
        endless = pool.submit(_post, live, _chat(max_tokens=8, guided_grammar=lark, logit_bias={str(c): 100}))
        beside = pool.submit(_post, live, _chat())
        response, plain = endless.result(), beside.result()
    assert response.status_code == 400, response.text[:2000]
    assert "MATCHER_CALL_BUDGET" in response.json()["error"]["message"], response.text[:2000]
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"], plain.text


def test_nesting_past_the_request_limit_is_a_400_before_anything_recurses(live):
    """150+ levels in a tool's parameters (the JSON Schema validator recursed past Python's limit)
    and in a response format, and `[` * 100,000 as an earlier tool call's arguments (Python's JSON
    parser did)."""
    for levels in (150, 900):
        body = json.dumps(_chat(tools=[tool({"type": "object", "properties": {"a": "DEEP"}})]))
        raw = body.replace('"DEEP"', deep_json_text(levels))
        message = _refused(live, raw, "MAX_JSON_NESTING", None)
        assert "nests JSON arrays or objects too deeply" in message
        raw = json.dumps(_chat(response_format=_json_schema({"type": "object", "default": "DEEP"})))
        _refused(live, raw.replace('"DEEP"', deep_json_text(levels)), "MAX_JSON_NESTING", None)
    arguments = deep_json_text(100_000)
    messages = [{"role": "user", "content": "Look it up."}, assistant_tool_call(arguments),
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "tools": [tool({"type": "object"})]}
    _refused(live, body, "MAX_JSON_NESTING", "messages")


def test_at_the_limits_requests_are_served(live):
    """Just under each limit the same shapes compile and the answer follows the grammar."""
    ok = [
        {"guided_json": ref_chain_schema(LIMITS["MAX_SCHEMA_DEPTH"] - 4)},
        {"guided_grammar": lark_rule_chain(LIMITS["MAX_LARK_DEPTH"] - 2)},
        {"guided_json": nested_schema(MAX_JSON_NESTING - 1)},
        {"tools": [tool(nested_schema(MAX_JSON_NESTING - 1))]},
        {"guided_regex": regex_repeat(LIMITS["MAX_REGEX_REPEAT"])},
        {"guided_choice": choices(LIMITS["MAX_CHOICES"])},
    ]
    for fields in ok:
        response = _post(live, _chat(max_tokens=8, **fields))
        assert response.status_code == 200, (list(fields), response.text[:1000])
    answer = _post(live, _chat(max_tokens=8, guided_choice=choices(LIMITS["MAX_CHOICES"]))).json()
    assert answer["choices"][0]["message"]["content"] in choices(LIMITS["MAX_CHOICES"])


def test_the_python_api_refuses_the_same_shapes_with_config_errors(engine):
    with pytest.raises(specrs.ConfigError, match="MAX_SCHEMA_DEPTH"):
        engine.generate("Hi", specrs.SamplingParams(max_tokens=2, json_schema=CHAIN))
    with pytest.raises(specrs.ConfigError, match="MAX_LARK_DEPTH"):
        engine.generate("Hi", specrs.SamplingParams(max_tokens=2, grammar=LARK_CHAIN))
    with pytest.raises(specrs.ConfigError, match="MAX_REGEX_REPEAT"):
        engine.check_params(specrs.SamplingParams(regex=regex_repeat(1_000_000)))
    # A dict nested past what Python's JSON encoder takes, and one just past the limit.
    for levels in (5000, MAX_JSON_NESTING):
        with pytest.raises(specrs.ConfigError, match="MAX_JSON_NESTING"):
            specrs.SamplingParams(json_schema={"type": "array", "default": nested_json_value(levels)})


def test_the_limits_are_the_engines():
    assert LIMITS == dict(specrs._specrs.GRAMMAR_LIMITS)
    assert set(LIMITS) >= {"MAX_JSON_NESTING", "MAX_SCHEMA_DEPTH", "MAX_LARK_DEPTH", "MAX_REGEX_REPEAT", "MAX_CHOICES"}
