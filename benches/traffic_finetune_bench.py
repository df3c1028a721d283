"""Fine-tuning a shipped head on recorded traffic (issue 21): acceptance before and after, on the
requests training held out.

The loop a user runs, end to end, in one process on SmolLM2-135M-Instruct:
1. Traffic of one type: "explain this code" requests over functions of Python's own standard
   library (the running Python's `.py` files, PSF license; no benchmark prompt, nothing
   downloaded), each a chat request for 128 greedy tokens, served by `specrs serve`'s app with
   `--record-traffic` (in process, Starlette's TestClient) with speculation off.
2. `specrs train-head features` over the recording, then `specrs train-head eagle3 --init` the
   shipped EAGLE-3 head, `--held-out 0.05` (every 20th request held out), `--epochs` as given.
3. `specrs advise DIR --held-out 0.05` with the shipped head and the fine-tuned one: acceptance
   rate and mean acceptance length at k = 4 (fixed), measured by specrs on the held-out requests,
   beside the trainer's own held-out figures before and after.

    python benches/traffic_finetune_bench.py --out bench-results/traffic_finetune.json

Prompts: functions of 6-40 lines picked in a fixed order (sorted files, every function that fits,
then a seeded shuffle), so a run is reproducible on the same Python.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

from specrs import Engine, advise
from specrs.heads import shipped_head
from specrs.train import eagle3, features

HELD_OUT = 0.05


def code_prompts(n: int, seed: int) -> list[str]:
    """n "explain this code" user turns over standard-library functions (6-40 lines each)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    functions = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and 6 <= node.end_lineno - node.lineno + 1 <= 40:
                functions.append("\n".join(lines[node.lineno - 1:node.end_lineno]))
    random.Random(seed).shuffle(functions)
    if len(functions) < n:
        raise SystemExit(f"only {len(functions)} functions of 6-40 lines in {stdlib}; ask for fewer")
    return [f"Explain what this Python function does:\n\n```python\n{f}\n```" for f in functions[:n]]


def record(engine: Engine, prompts: list[str], directory: Path, max_tokens: int) -> float:
    """Serves every prompt once through the OpenAI app with --record-traffic; returns seconds."""
    from starlette.testclient import TestClient

    from specrs.serve import build_app

    t0 = time.perf_counter()
    with TestClient(build_app(engine, "traffic", record_traffic=directory)) as http:
        for i, prompt in enumerate(prompts):
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                    "speculative": False}
            r = http.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                raise SystemExit(f"request {i} failed: {r.status_code} {r.text}")
            print(f"\rrecorded {i + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/specrs-train/traffic-code"),
                    help="directory for the recording, features and the fine-tuned head (reused if present)")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record-only", action="store_true",
                    help="stop after the recording and its features (a later run reuses both)")
    ap.add_argument("--out", default="bench-results/traffic_finetune.json")
    args = ap.parse_args()

    work = Path(args.work)
    engine = Engine()
    shipped = None if args.record_only else shipped_head(engine.info(), "eagle3")
    report: dict = {"model": engine.model_path, "shipped_head": shipped, "traffic": "explain standard-library Python "
                    "functions (chat, greedy)", "num_requests": args.num_requests, "max_tokens": args.max_tokens,
                    "held_out": HELD_OUT, "epochs": args.epochs, "lr": args.lr}

    traffic = work / "traffic"
    if not (traffic / "traffic.jsonl").exists():
        seconds = record(engine, code_prompts(args.num_requests, args.seed), traffic, args.max_tokens)
        (work / "record_seconds.json").write_text(json.dumps(round(seconds, 1)))
    report["record_seconds"] = json.loads((work / "record_seconds.json").read_text())
    t0 = time.perf_counter()
    index = features.extract(engine, str(traffic / "traffic.jsonl"), str(work / "features"))
    report["features_seconds"] = round(time.perf_counter() - t0, 1)
    report["traffic_tokens"] = index["num_tokens"]
    if args.record_only:
        return 0

    tuned = work / "eagle3-tuned"
    trainer = eagle3.train(eagle3.arguments().parse_args([
        "--features", str(work / "features"), "--target", engine.model_path, "--init", shipped, "--out", str(tuned),
        "--epochs", str(args.epochs), "--lr", str(args.lr), "--warmup", "20", "--held-out", str(HELD_OUT)]))
    report["trainer"] = trainer

    configs = [json.dumps({"method": "eagle3", "model": d}) for d in (shipped, str(tuned))]
    advice = advise.advise(str(traffic), methods="", configs=configs, max_k=4, max_tokens=args.max_tokens,
                           num_prompts=None, progress=True, held_out=HELD_OUT)
    before, after = advice["candidates"]
    report["advise"] = {
        "num_held_out_requests": advice["num_prompts"],
        "before": {k: before[k] for k in ("acceptance_rate", "acceptance_rate_per_pos", "mean_acceptance_length",
                                          "measured_speedup")},
        "after": {k: after[k] for k in ("acceptance_rate", "acceptance_rate_per_pos", "mean_acceptance_length",
                                        "measured_speedup")},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({"trainer_held_out_before": trainer.get("held_out_before"), "trainer_held_out": trainer["held_out"],
                      **report["advise"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
