"""Write tests/golden/gguf/: each tiny random model of tests/golden/hf/ converted to GGUF by
llama.cpp's own converter (f32 and Q8_0), and llama.cpp's logits for it. tests/test_gguf_families.py
loads each file with specrs and compares; the suite reads only these files.

This checks what the HF goldens cannot: that specrs reads llama.cpp's GGUF files of every family
(tensor names, q/k permutation, norm offsets, fused projections, metadata keys) the way llama.cpp
does. Only the vocabulary is written here, as a numbered SentencePiece list (the tiny models have a
word-level tokenizer the converter does not know); the tests feed token ids.

Needs llama-cpp-python 0.3.36 (see scripts/make_golden.py), torch and transformers in the same
Python, and the llama.cpp source of the same version (its converter and gguf-py), e.g. the one
vendored in llama-cpp-python's sdist:
    /tmp/llamacpp/bin/pip install torch transformers sentencepiece safetensors
    /tmp/llamacpp/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/src
    tar xzf /tmp/src/llama_cpp_python-0.3.36.tar.gz -C /tmp/src
    /tmp/llamacpp/bin/python scripts/make_gguf_golden.py \\
        --llama-cpp /tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HF = ROOT / "tests" / "golden" / "hf"
OUT = ROOT / "tests" / "golden" / "gguf"
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]
TYPES = ["q8_0"]
VOCAB = 256


def convert(llama_cpp: Path, family: str, out_type: str, out: Path) -> None:
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(1, str(llama_cpp / "gguf-py"))
    import gguf
    import torch
    from conversion import ModelBase, get_model_architecture, get_model_class

    def numbered_vocab(model) -> None:
        w = model.gguf_writer
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list([f"t{i}" for i in range(VOCAB)])
        w.add_token_scores([0.0] * VOCAB)
        types = [gguf.TokenType.NORMAL] * VOCAB
        types[0], types[1], types[2] = gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)

    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[out_type]
    directory = HF / family
    with torch.inference_mode():
        hparams = ModelBase.load_hparams(directory, False)
        model_class = get_model_class(get_model_architecture(hparams, None), mmproj=False)
        model_class.set_vocab = numbered_vocab
        # A neutral name: llama.cpp special-cases some vocabularies by model name (Phi-3's).
        model_class(directory, ftype, out, eager=True, model_name="specrs tiny random model").write()


def reference(path: Path, input_ids: list[int]) -> dict:
    """llama.cpp's logits for `input_ids`, every token evaluated alone (its single-token kernels)
    and in one batch."""
    from llama_cpp import Llama

    common = dict(model_path=str(path), n_ctx=128, n_batch=128, n_ubatch=128, n_threads=2, n_threads_batch=2,
                  seed=0, verbose=False)
    stepper = Llama(logits_all=False, **common)
    stepwise = []
    for tok in input_ids:
        stepper.eval([tok])
        stepwise.append(np.ctypeslib.as_array(stepper._ctx.get_logits(), shape=(stepper.n_vocab(),)).copy())
    batched = Llama(logits_all=True, **common)
    batched.eval(input_ids)
    whole = np.asarray(batched.scores[: len(input_ids)])
    return {"stepwise": np.asarray(stepwise), "batched": whole}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source (convert_hf_to_gguf.py's folder)")
    args = ap.parse_args()
    import llama_cpp

    OUT.mkdir(parents=True, exist_ok=True)
    for family in FAMILIES:
        input_ids = json.loads((HF / family / "golden.json").read_text())["input_ids"]
        for out_type in TYPES:
            path = OUT / f"{family}-{out_type}.gguf"
            convert(args.llama_cpp, family, out_type, path)
            ref = reference(path, input_ids)
            golden = {
                "reference": f"llama-cpp-python {llama_cpp.__version__}",
                "input_ids": input_ids,
                # f32 logits are exact in JSON (repr round-trips).
                "logits_stepwise": [[float(x) for x in row] for row in ref["stepwise"]],
                "top1_batched": [int(i) for i in ref["batched"].argmax(axis=1)],
                "max_diff_batched_vs_stepwise": float(np.abs(ref["batched"] - ref["stepwise"]).max()),
            }
            (OUT / f"{family}-{out_type}.json").write_text(json.dumps(golden))
            print(f"{path.name}: {path.stat().st_size / 1e3:.0f} KB; llama.cpp batched vs single-token max |diff| "
                  f"{golden['max_diff_batched_vs_stepwise']:.2e}", flush=True)


if __name__ == "__main__":
    main()
