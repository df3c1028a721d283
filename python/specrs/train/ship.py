"""`specrs train-head ship`: a trained head directory made into a shipped one (specrs.heads).

    specrs train-head ship --head DIR --out python/specrs/heads/smollm2-135m/eagle3 \
        --training-json report.json

Copies config.json, rewrites model.safetensors with every float32 tensor as bfloat16 (half the
bytes; drafting reads them back as float32) and writes `training.json`: the trainer's report and
whatever else `--training-json` holds (data recipe, times), so a shipped head says how it was made.

Invariant: the shipped head holds the same tensor names and shapes as the trained one; only float
precision changes (int64 tensors such as d2t are copied exactly).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from .safetensors import read_safetensors, write_safetensors


def ship(head_dir: str, out_dir: str, training: dict) -> dict:
    """Writes the shipped copy of `head_dir` to `out_dir`; returns {file: bytes}."""
    for name in ("config.json", "model.safetensors"):
        if not os.path.isfile(os.path.join(head_dir, name)):
            raise SystemExit(f"{head_dir} has no {name}: pass a directory written by `specrs train-head eagle3` "
                             "or `specrs train-head mlp_speculator`")
    os.makedirs(out_dir, exist_ok=True)
    shutil.copyfile(os.path.join(head_dir, "config.json"), os.path.join(out_dir, "config.json"))
    tensors = read_safetensors(os.path.join(head_dir, "model.safetensors"))
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, bfloat16=True)
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump(training, f, indent=1)
    return {name: os.path.getsize(os.path.join(out_dir, name)) for name in sorted(os.listdir(out_dir))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specrs train-head ship", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", required=True, help="a head directory written by a trainer")
    parser.add_argument("--out", required=True, help="where the shipped copy goes (python/specrs/heads/MODEL/METHOD)")
    parser.add_argument("--training-json", default=None,
                        help="a JSON file describing the training (report, data recipe, times) kept as training.json")
    args = parser.parse_args(argv)
    training = json.load(open(args.training_json)) if args.training_json else {}
    print(json.dumps(ship(args.head, args.out, training)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
