"""The property the server's request parser must keep, shared by the atheris fuzzer
(`fuzz_protocol.py`) and the regression test (`tests/test_fuzz_protocol.py`).

For any request body (bytes): `parse_json_body` + `parse_request` either return a
`GenerationRequest` or raise an `APIError` with a 4xx status whose body is JSON; and a request they
accept is admitted by the engine as the scheduler admits it (`Engine.stream`), or refused with an
error the server answers with a 4xx. Anything else (another exception, a 5xx) is a bug.
"""

from __future__ import annotations

import json

from specrs.serve import protocol

SERVED_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"

# The server's default speculation, by the harness's first choice: none, ngram, suffix.
SERVER_CONFIGS = [None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                         "prompt_lookup_max": 4}, {"method": "suffix", "num_speculative_tokens": 4}]


def server_speculations() -> list[protocol.ServerSpeculation]:
    out = []
    for config in SERVER_CONFIGS:
        parsed = None if config is None else json.loads(protocol._parse_config(config).to_json())
        out.append(protocol.ServerSpeculation(parsed))
    return out


class PropertyViolation(AssertionError):
    pass


def check(engine, speculation: protocol.ServerSpeculation, kind: str, raw: bytes) -> str:
    """Runs one body through the parser and admission; returns "accepted" or "refused", raises
    PropertyViolation (or the unexpected exception itself) otherwise."""
    try:
        body = protocol.parse_json_body(raw)
        request = protocol.parse_request(kind, body, engine, SERVED_MODEL_NAME, speculation)
    except protocol.APIError as e:
        if not 400 <= e.status < 500:
            raise PropertyViolation(f"{kind} body {raw[:300]!r} got status {e.status}: {e.message}") from e
        # As Starlette's JSONResponse writes it.
        json.dumps(e.body(), ensure_ascii=False, allow_nan=False).encode("utf-8")
        return "refused"
    try:
        stream = engine.stream(request.prompt_ids, request.params,
                               speculative_config=request.speculative_config or False)
    except Exception as e:  # noqa: BLE001 - the scheduler answers any admission error this way
        error = protocol.api_error_from(e)
        if error.status >= 500:
            raise PropertyViolation(f"{kind} body {raw[:300]!r} was accepted by parse_request but its admission "
                                    f"fails with a {error.status}: {error.message}") from e
        return "refused"
    stream.cancel()
    return "accepted"
