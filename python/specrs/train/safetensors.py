"""safetensors files without the safetensors package (the heads' only file format): a header of
JSON, then the tensors' bytes. Written atomically (a temporary file, renamed).

Invariant: read_safetensors(write_safetensors(t)) == t for float32, bfloat16 (stored as float32
rounded to nearest even, read back as float32), float16 and int64 tensors.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np


def to_bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns of float32 `array`, rounded to nearest even."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    return (rounded >> 16).astype(np.uint16)


def write_safetensors(path: str | os.PathLike[str], tensors: dict[str, np.ndarray], bfloat16: bool = False) -> None:
    """float32 / float16 / int64 tensors to a safetensors file; with `bfloat16`, float32 tensors are
    stored as bfloat16 (half the bytes: how shipped heads are stored)."""
    path = os.fspath(path)
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        if array.dtype == np.float32 and bfloat16:
            dtype, blob = "BF16", to_bfloat16_bits(array).tobytes()
        else:
            dtype = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64"}[array.dtype]
            blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    os.replace(path + ".tmp", path)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """F32/F16/BF16/I64/BOOL tensors of a safetensors file."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[start:end]
        if info["dtype"] == "BF16":
            array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(raw, {"F32": np.float32, "F16": np.float16, "I64": np.int64, "BOOL": np.bool_}[info["dtype"]])
        out[name] = array.reshape(info["shape"])
    return out
