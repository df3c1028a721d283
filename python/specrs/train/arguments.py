"""The command lines of the head trainers (`specrs train-head eagle3 | mlp_speculator | dflash`), kept apart
from their torch code: `specrs train-head eagle3 --help` shows the flags on a machine without the
train extra, and a run without torch fails after its flags were checked, saying how to get it.

Invariant: importing this module imports neither torch nor the trainers; each parser's
description is its trainer's module docstring, read from the source file.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path


def stage_parser(stage: str, module: str) -> argparse.ArgumentParser:
    """A stage's parser: usage `specrs train-head STAGE ...`, description the module's docstring."""
    spec = importlib.util.find_spec(f"specrs.train.{module}")
    source = Path(spec.origin).read_text(encoding="utf-8") if spec is not None and spec.origin else ""
    return argparse.ArgumentParser(prog=f"specrs train-head {stage}", description=ast.get_docstring(ast.parse(source)),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_trainer_arguments(parser: argparse.ArgumentParser, lr: float) -> None:
    """The options every trainer takes."""
    parser.add_argument("--features", required=True, help="directory from `specrs train-head features`")
    parser.add_argument("--out", required=True, help="head directory to write (and its checkpoint.pt)")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--held-out", type=float, default=0.05,
                        help="fraction of conversations (every k-th) kept out of training for evaluation")
    parser.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-bf16", dest="bf16", action="store_false",
                        help="train in float32 (default: bfloat16 autocast, ~2x faster on CPUs with AVX512-BF16)")


def eagle3() -> argparse.ArgumentParser:
    parser = stage_parser("eagle3", "eagle3")
    add_trainer_arguments(parser, lr=3e-4)
    parser.add_argument("--target", required=True, help="the target's GGUF or Hugging Face directory "
                        "(its embedding and LM head are read)")
    parser.add_argument("--init", default=None, help="an EAGLE-3 head directory to fine-tune (its shape and draft "
                        "vocabulary are kept)")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--rope-theta", type=float, default=100000.0)
    parser.add_argument("--ttt-steps", type=int, default=4)
    parser.add_argument("--fc-norm", action="store_true", help="RMS-norm each tapped layer before fc (speculators' "
                        "fc_norm; for targets whose layers differ in scale, such as Gemma 3)")
    return parser


def mlp_speculator() -> argparse.ArgumentParser:
    parser = stage_parser("mlp_speculator", "mlp_speculator")
    add_trainer_arguments(parser, lr=1e-3)
    parser.add_argument("--init", default=None, help="an MLP speculator directory to fine-tune (its shape is kept)")
    parser.add_argument("--vocab", type=int, default=49152, help="the target's vocabulary size")
    parser.add_argument("--inner", type=int, default=256)
    parser.add_argument("--n-predict", type=int, default=3)
    return parser


def dflash() -> argparse.ArgumentParser:
    parser = stage_parser("dflash", "dflash")
    add_trainer_arguments(parser, lr=6e-4)
    parser.add_argument("--target", required=True, help="the target's GGUF or Hugging Face directory "
                        "(its embedding, LM head and depth are read)")
    parser.add_argument("--layers", type=int, default=1, help="the drafter's decoder layers")
    parser.add_argument("--block-size", type=int, default=8,
                        help="rows of a block: the newest token and block-size - 1 drafts")
    parser.add_argument("--anchors", type=int, default=16, help="blocks trained per conversation per step")
    parser.add_argument("--decay", type=float, default=0.8, help="loss weight of block row j: decay^(j - 1)")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="the mask token (default: the token the cached responses use least)")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--rope-theta", type=float, default=100000.0)
    return parser
