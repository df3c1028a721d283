"""A minimal GGUF v3 reader and writer for malformed-input tests: metadata-only files, and copies of
a real file with its metadata, tensor shapes or tensor data changed (`GgufModel`)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# GGUF metadata value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
           BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
# ggml tensor types: (values per block, bytes per block), for the types the tests use.
GGML_TYPES = {0: (1, 4), 1: (1, 2), 8: (32, 34)}  # F32, F16, Q8_0
ALIGNMENT = 32


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


@dataclass
class Tensor:
    name: str
    dims: list[int]  # GGUF order: dims[0] is the row length (ne[0])
    ggml_type: int
    data: bytes

    def num_bytes(self) -> int:
        values, block_bytes = GGML_TYPES[self.ggml_type]
        count = 1
        for d in self.dims:
            count *= d
        return count // values * block_bytes


@dataclass
class GgufModel:
    """A GGUF file in memory: metadata as (type, value) with arrays as (item type, [values]), and
    tensors in file order."""

    metadata: dict[str, tuple[int, object]] = field(default_factory=dict)
    tensors: list[Tensor] = field(default_factory=list)

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def drop(self, name: str) -> None:
        self.tensors = [t for t in self.tensors if t.name != name]

    def set_int(self, key: str, value: int) -> None:
        """Replaces an integer key's value, keeping its type."""
        kind, _ = self.metadata[key]
        self.metadata[key] = (kind, value)

    @staticmethod
    def read(path) -> "GgufModel":
        with open(path, "rb") as f:
            buf = f.read()
        pos = 0

        def take(fmt):
            nonlocal pos
            values = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return values[0] if len(values) == 1 else values

        def string():
            nonlocal pos
            n = take("<Q")
            s = buf[pos:pos + n].decode("utf-8")
            pos += n
            return s

        def value(kind):
            if kind == STRING:
                return string()
            if kind == ARRAY:
                item, n = take("<I"), take("<Q")
                return item, [value(item) for _ in range(n)]
            return take(_SCALAR[kind])

        magic, version = buf[:4], struct.unpack_from("<I", buf, 4)[0]
        assert magic == b"GGUF" and version == 3, (magic, version)
        pos = 8
        num_tensors, num_kv = take("<Q"), take("<Q")
        model = GgufModel()
        for _ in range(num_kv):
            key = string()
            kind = take("<I")
            model.metadata[key] = (kind, value(kind))
        infos = []
        for _ in range(num_tensors):
            name = string()
            n_dims = take("<I")
            dims = [take("<Q") for _ in range(n_dims)]
            infos.append((name, dims, take("<I"), take("<Q")))
        data_start = (pos + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        for name, dims, ggml_type, offset in infos:
            t = Tensor(name, dims, ggml_type, b"")
            start = data_start + offset
            t.data = buf[start:start + t.num_bytes()]
            model.tensors.append(t)
        return model

    def write(self, path, offsets: dict[str, int] | None = None, cut: int = 0) -> None:
        """Writes the file; `offsets` overrides tensors' recorded data offsets (the data stays where
        it is), `cut` drops that many bytes from the end."""

        def encode(kind, v) -> bytes:
            if kind == STRING:
                return _string(v)
            if kind == ARRAY:
                item, values = v
                return struct.pack("<IQ", item, len(values)) + b"".join(encode(item, x) for x in values)
            return struct.pack(_SCALAR[kind], v)

        out = bytearray(b"GGUF") + struct.pack("<IQQ", 3, len(self.tensors), len(self.metadata))
        for key, (kind, v) in self.metadata.items():
            out += _string(key) + struct.pack("<I", kind) + encode(kind, v)
        data = bytearray()
        for t in self.tensors:
            offset = len(data)
            out += _string(t.name) + struct.pack("<I", len(t.dims)) + b"".join(struct.pack("<Q", d) for d in t.dims)
            out += struct.pack("<IQ", t.ggml_type, (offsets or {}).get(t.name, offset))
            data += t.data
            data += b"\0" * (-len(data) % ALIGNMENT)
        out += b"\0" * (-len(out) % ALIGNMENT)
        out += data
        with open(path, "wb") as f:
            f.write(bytes(out[: len(out) - cut]))
