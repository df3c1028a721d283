"""Coverage-guided fuzzing (atheris, libFuzzer's engine) of `specrs serve`'s request parser:
`protocol.parse_json_body` + `protocol.parse_request` + admission, against the property in
`protocol_harness.py`, on the real default engine (SmolLM2, loaded once).

Each input's first byte picks the endpoint and the server's default speculation; the second picks
raw mode (even: the rest is the body as sent) or structured mode (odd (a JSON object built from the API's
field names and edge-case values: NaN, huge and 4300+-digit numbers, deep nesting, wrong types)).

    .venv/bin/python fuzz/python/fuzz_protocol.py CORPUS_DIR -max_total_time=60   # make fuzz does this
"""

from __future__ import annotations

import json
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["specrs", "protocol_harness"]):
    import protocol_harness
    from specrs.serve import protocol

import specrs  # noqa: E402

FIELDS = sorted(protocol.CHAT_FIELDS | protocol.COMPLETION_FIELDS | set(protocol.UNSUPPORTED_UNLESS_DEFAULT)
                | protocol.IGNORED_FIELDS) + ["speculative", "prompt", "messages", "x"]
SPEC_KEYS = ["method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "quantization",
             "exit_layer", "adaptive_draft_length", "draft_confidence_threshold", "suffix_decoding_max_tree_depth"]
STRINGS = ["", "Hello", "user", "assistant", "system", "ngram", "suffix", "custom", "draft_model", "pard",
           "quantized_self", "layer_skip", "text", "image_url", protocol_harness.SERVED_MODEL_NAME, "<|im_end|>",
           "\x00", "\ud800", "stop", "q4_0"]


def json_text(fdp: atheris.FuzzedDataProvider, depth: int = 0) -> str:
    """A JSON value as text: built by hand so it can hold what json.dumps refuses to write."""
    choice = fdp.ConsumeIntInRange(0, 17 if depth < 3 else 11)
    if choice == 0:
        return "null"
    if choice == 1:
        return fdp.PickValueInList(["true", "false"])
    if choice == 2:
        return str(fdp.PickValueInList([0, 1, -1, 2, 4, 16, 64, 128, 8192, 2**31, 2**32, 2**63, 2**64, -2**63]))
    if choice == 3:
        return str(fdp.ConsumeInt(8))
    if choice == 4:
        return fdp.PickValueInList(["0.5", "1.0", "1e-45", "1e309", "-0.0", "NaN", "Infinity", "-Infinity", "2.5"])
    if choice == 5:
        return repr(fdp.ConsumeFloat())
    if choice == 6:
        return "1" * fdp.ConsumeIntInRange(4290, 4310)  # around Python's int-string limit (4300 digits)
    if choice in (7, 8):
        return protocol_json_string(fdp.PickValueInList(STRINGS))
    if choice == 9:
        return protocol_json_string(fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40)))
    if choice == 10:
        n = fdp.ConsumeIntInRange(0, 6)
        return "[" + ",".join(str(fdp.ConsumeIntInRange(-5, 50000)) for _ in range(n)) + "]"
    if choice == 11:
        n = fdp.ConsumeIntInRange(1, 3000)  # deep nesting
        return "[" * n + "]" * n
    if choice in (12, 13):
        n = fdp.ConsumeIntInRange(0, 4)
        return "[" + ",".join(json_text(fdp, depth + 1) for _ in range(n)) + "]"
    if choice == 14:
        n = fdp.ConsumeIntInRange(0, 3)
        parts = [f'{{"role": {json_text(fdp, depth + 1)}, "content": {json_text(fdp, depth + 1)}}}' for _ in range(n)]
        return "[" + ",".join(parts) + "]"
    if choice == 15:
        return '[{"type": "text", "text": ' + json_text(fdp, depth + 1) + "}]"
    return json_object(fdp, SPEC_KEYS, depth + 1)


def protocol_json_string(s: str) -> str:
    return json.dumps(s)


def json_object(fdp: atheris.FuzzedDataProvider, keys: list[str], depth: int) -> str:
    n = fdp.ConsumeIntInRange(0, 6)
    items = []
    for _ in range(n):
        key = fdp.PickValueInList(keys) if fdp.ConsumeIntInRange(0, 9) else fdp.ConsumeUnicodeNoSurrogates(8)
        items.append(f"{protocol_json_string(key)}: {json_text(fdp, depth)}")
    return "{" + ", ".join(items) + "}"


ENGINE = None
SPECULATIONS = None


def test_one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    selector, mode, rest = data[0], data[1], data[2:]
    kind = "chat" if selector % 2 else "completion"
    speculation = SPECULATIONS[(selector // 2) % len(SPECULATIONS)]
    if mode % 2 == 0:
        raw = rest
    else:
        raw = json_object(atheris.FuzzedDataProvider(rest), FIELDS, 0).encode("utf-8", "surrogatepass")
    protocol_harness.check(ENGINE, speculation, kind, raw)


def main() -> None:
    global ENGINE, SPECULATIONS
    atheris.Setup(sys.argv, test_one_input)
    ENGINE = specrs.Engine()  # loaded once, before the first input (its load is no input's time)
    SPECULATIONS = protocol_harness.server_speculations()
    atheris.Fuzz()


if __name__ == "__main__":
    main()
