"""Regressions found by fuzzing the server's request parser (fuzz/python/fuzz_protocol.py): each
body below made `parse_json_body` / `parse_request` raise something other than a 4xx `APIError`,
or let through a request whose admission failed with a 500. The property they are checked
against is the fuzzer's own (fuzz/python/protocol_harness.py), and the checked-in raw-mode fuzzer
inputs under fuzz/regressions/protocol/ are replayed through it too (structured-mode ones need
atheris to decode; fuzz/run.sh replays those).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FUZZ_PYTHON = Path(__file__).resolve().parent.parent / "fuzz" / "python"
sys.path.insert(0, str(FUZZ_PYTHON))

import protocol_harness  # noqa: E402

from specrs.serve import protocol  # noqa: E402

# The fuzzer's input layout: byte 0 = endpoint and server speculation, byte 1 even = the raw body.
REGRESSIONS = [p for p in sorted((FUZZ_PYTHON.parent / "regressions" / "protocol").iterdir())
               if p.read_bytes()[1] % 2 == 0]

# (endpoint, body, what the refusal's message says)
REFUSED = [
    ("completion", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests JSON arrays or objects too deeply"),
    ("completion", b'{"prompt": "x", "max_tokens": ' + b"1" * 4301 + b"}", "Exceeds the limit (4300 digits)"),
    ("completion", b'{"prompt": "\\ud800"}', "lone UTF-16 surrogate"),
    ("chat", b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}', "lone UTF-16 surrogate"),
    ("completion", b'{"prompt": [104, -5, -5]}', "prompt token id -5 is outside the vocabulary (ids are 0..49151)"),
    ("completion", b'{"prompt": [1, 4294967296]}', "prompt token id 4294967296 is outside the vocabulary"),
    ("completion", b'{"prompt": "x", "seed": ' + str(2**70).encode() + b"}", "seed must be an integer in 0..=18446744073709551615"),
    ("completion", b'{"prompt": "x", "top_k": ' + str(2**64).encode() + b"}", "top_k must be an integer in -1..=9223372036854775807"),
    ("completion", b'{"prompt": "x", "temperature": ' + b"9" * 400 + b"}", "temperature must be a finite number"),
]


@pytest.fixture(scope="module")
def speculation() -> protocol.ServerSpeculation:
    return protocol_harness.server_speculations()[1]  # the server's default: ngram


@pytest.mark.parametrize("kind,body,message", REFUSED, ids=[m[:30] for _, _, m in REFUSED])
def test_fuzzer_findings_are_client_errors(engine, speculation, kind, body, message):
    with pytest.raises(protocol.APIError) as refused:
        protocol.parse_request(kind, protocol.parse_json_body(body), engine, protocol_harness.SERVED_MODEL_NAME,
                               speculation)
    assert refused.value.status == 400
    assert message in refused.value.message
    assert protocol_harness.check(engine, speculation, kind, body) == "refused"


def test_valid_requests_are_still_admitted(engine, speculation):
    for kind, body in [("completion", b'{"prompt": [1, 2, 3], "max_tokens": 2, "seed": 9223372036854775807}'),
                       ("chat", b'{"messages": [{"role": "user", "content": "caf\\u00e9 \\ud83d\\ude00"}], "top_k": 5}')]:
        assert protocol_harness.check(engine, speculation, kind, body) == "accepted"


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
def test_checked_in_fuzzer_inputs_keep_the_property(engine, path):
    data = path.read_bytes()
    speculations = protocol_harness.server_speculations()
    kind = "chat" if data[0] % 2 else "completion"
    protocol_harness.check(engine, speculations[(data[0] // 2) % len(speculations)], kind, data[2:])
