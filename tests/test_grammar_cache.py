"""The engine's grammar cache (crates/specrs-core/src/constraint/cache.rs) through `specrs serve`
and the Python API: a request's grammar is compiled once, though the server checks it before it
answers and the request compiles it again when it starts, and a schema sent again is not compiled
again (`Engine.metrics()`'s `num_grammar_compiles` / `num_grammar_cache_hits`); what comes out of a
cached grammar is what a fresh engine, which compiles it anew, gives."""

from __future__ import annotations

import pytest

import specrs

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402  (needs the serve extra, checked above)

from specrs.serve import build_app  # noqa: E402

MODEL = "grammar-cache-model"
PROMPT = "Maria Lopez is 34 and lives in Madrid. As JSON:"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                   "city": {"type": "string", "maxLength": 20}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
# The same properties in another order: another grammar (llguidance writes them in the order given).
SCHEMA_CITY_FIRST = {**SCHEMA, "properties": {key: SCHEMA["properties"][key] for key in ("city", "name", "age")}}


def _counts(engine: specrs.Engine) -> tuple[int, int]:
    metrics = engine.metrics()
    return metrics["num_grammar_compiles"], metrics["num_grammar_cache_hits"]


def _fresh(schema: dict, max_tokens: int) -> str:
    """What an engine that never saw `schema` writes for it (greedy, chat)."""
    params = specrs.SamplingParams(temperature=0, max_tokens=max_tokens, json_schema=schema)
    return specrs.Engine().generate([{"role": "user", "content": PROMPT}], params, speculative_config=False).text


def test_a_server_request_compiles_its_schema_once():
    engine = specrs.Engine()
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    with TestClient(build_app(engine, MODEL, max_num_seqs=2)) as http:
        first = http.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        assert _counts(engine) == (1, 1)  # the 400 check compiled it; the request's start took the copy
        second = http.post("/v1/chat/completions", json=body)
        assert _counts(engine) == (1, 3)  # the same schema again: nothing compiled
        other = http.post("/v1/chat/completions", json={**body, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA_CITY_FIRST}}})
        assert _counts(engine) == (2, 4)  # another order of properties is another grammar
    texts = [response.json()["choices"][0]["message"]["content"] for response in (first, second, other)]
    assert texts[0] == texts[1] == _fresh(SCHEMA, 48)
    assert texts[2] == _fresh(SCHEMA_CITY_FIRST, 48)
    assert texts[0].startswith('{"name": ') and texts[2].startswith('{"city": '), texts


def test_a_batch_with_one_schema_compiles_it_once_and_decodes_as_a_fresh_engine():
    engine = specrs.Engine()
    params = specrs.SamplingParams(temperature=0, max_tokens=32, json_schema=SCHEMA)
    prompts = [[{"role": "user", "content": PROMPT}]] * 3
    results = engine.generate(prompts, params, speculative_config=False, progress=False)
    assert _counts(engine) == (1, 2)
    assert [r.text for r in results] == [_fresh(SCHEMA, 32)] * 3
    # A failing schema is compiled (and refused) each time, with the same message.
    bad = specrs.SamplingParams(json_schema={"type": "object", "properties": {"x": {"$ref": "#/$defs/none"}}})
    messages = []
    for _ in range(2):
        with pytest.raises(specrs.ConfigError) as refused:
            engine.check_params(bad)
        messages.append(str(refused.value))
    assert messages[0] == messages[1] and _counts(engine) == (3, 2)
    engine.reset_metrics()
    assert _counts(engine) == (0, 0)
