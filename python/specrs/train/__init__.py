"""Training heads of our own (`specrs train-head STAGE`): self-instruct data, hidden-state caches,
the trainers, and shipping a head. `run_stage` is the command line's entry: the trainers' flags
are parsed before torch is imported (train/arguments.py), so their `--help` needs no train extra."""

from __future__ import annotations

import importlib
import json

from .. import extras

# Stage name on the command line -> module under specrs.train.
STAGES = {"data": "selfinstruct", "features": "features", "eagle3": "eagle3",
          "mlp_speculator": "mlp_speculator", "dflash": "dflash", "ship": "ship"}
TRAINERS = ("eagle3", "mlp_speculator", "dflash")


def run_stage(stage: str, argv: list[str]) -> int:
    """Runs `specrs train-head STAGE ARGV...`."""
    if stage not in TRAINERS:
        return importlib.import_module(f"specrs.train.{STAGES[stage]}").main(argv)
    from . import arguments

    args = getattr(arguments, stage)().parse_args(argv)
    # After the flags (so --help needs no torch), before anything loads.
    extras.require("train", f"specrs train-head {stage}")
    trainer = importlib.import_module(f"specrs.train.{STAGES[stage]}")
    print(json.dumps(trainer.train(args)))
    return 0
