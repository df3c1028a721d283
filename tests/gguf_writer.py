"""A minimal GGUF v3 writer for malformed-input tests (metadata only, no tensors)."""

import struct

STRING, UINT32, ARRAY = 8, 4, 9


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def write_metadata_only(path, metadata: dict) -> None:
    """A GGUF file with the given metadata (str, int or list-of-str values) and no tensors."""
    out = bytearray(b"GGUF")
    out += struct.pack("<IQQ", 3, 0, len(metadata))
    for key, value in metadata.items():
        out += _string(key)
        if isinstance(value, str):
            out += struct.pack("<I", STRING) + _string(value)
        elif isinstance(value, list):
            out += struct.pack("<IIQ", ARRAY, STRING, len(value)) + b"".join(_string(v) for v in value)
        else:
            out += struct.pack("<I", UINT32) + struct.pack("<I", value)
    with open(path, "wb") as f:
        f.write(bytes(out))
