"""How much `specrs bench` speedups spread between runs (issue 39 item 4: numbers a user can trust).

Runs `specrs bench` `--bench-runs` times (default 5) in fresh processes on the same prompts and
configs, `--repeats 1` each where the option exists (so each run gives one figure, as one run of
an older specrs did), and reports per config the overall speedup of each run and their min, median
and max, with the verdict specrs gave each (a speedup, or timing noise: above the run's ceiling,
or no drafts). Quiet, and beside one busy-loop process per core too with `--busy`.

It runs on older specrs too (no shipped prompts: pass `--prompts`; no `--repeats`, no verdicts),
so the same script gives the before and after of a change. After `make build`:

    .venv/bin/python benches/speedup_spread_bench.py --busy --out bench-results/speedup_spread.json

Output: a table on stdout and, with `--out`, JSON: {"settings", "machine", "specrs", "commit",
"bench_spread": {"<load>": {"<config>": {"speedups": [...], "verdicts": [...], "min", "median", "max"}}}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from first_request_bench import busy_loops, write_report  # benches/ is the script's folder

DEFAULT_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"min": None, "median": None, "max": None}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def bench_spread(args, configs: list[dict]) -> dict:
    import specrs.bench as bench

    prompts = args.prompts or getattr(bench, "SHIPPED_PROMPTS", None)
    if prompts is None:
        raise SystemExit("this specrs ships no prompt set: pass --prompts PROMPTS.jsonl")
    help_text = subprocess.run([sys.executable, "-m", "specrs.cli", "bench", "--help"], capture_output=True,
                               text=True, check=True).stdout
    out = {}
    for load in (["quiet", "busy"] if args.busy else ["quiet"]):
        speedups: dict[str, list] = {}
        verdicts: dict[str, list] = {}
        with tempfile.TemporaryDirectory() as tmp, busy_loops(load == "busy"):
            for i in range(args.bench_runs):
                path = Path(tmp) / f"bench-{i}.json"
                cmd = [sys.executable, "-m", "specrs.cli", "bench", "--prompts", str(prompts), "--max-tokens",
                       str(args.max_tokens), "--json", str(path), "--no-progress"]
                for config in configs:
                    cmd += ["--config", json.dumps(config)]
                if args.num_per_category:
                    cmd += ["--num-per-category", str(args.num_per_category)]
                if "--repeats" in help_text:
                    cmd += ["--repeats", "1"]
                run = subprocess.run(cmd, capture_output=True, text=True)
                if run.returncode != 0:
                    raise RuntimeError(f"specrs bench failed:\n{run.stderr}")
                overall = json.loads(path.read_text())["overall"]
                for label, agg in overall.items():
                    if label == "baseline":
                        continue
                    stats = agg.get("speedup_stats")
                    # Newer specrs: the median even when it says it is noise; older: the ratio.
                    speedups.setdefault(label, []).append(stats["median"] if stats else agg["speedup"])
                    verdicts.setdefault(label, []).append(stats["verdict"] if stats else None)
        out[load] = {label: {"speedups": values, "verdicts": verdicts[label], **spread(values)}
                     for label, values in speedups.items()}
        for label, s in out[load].items():
            print(f"bench {load:<5} {label:<40} speedup {s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f} "
                  f"(min / median / max of {len(s['speedups'])} runs; verdicts {s['verdicts']})", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=None,
                    help="a speculative config (JSON); repeatable (default: ngram k=4)")
    ap.add_argument("--prompts", default=None, help="prompts (default: the set specrs ships)")
    ap.add_argument("--bench-runs", type=int, default=5, help="fresh `specrs bench` processes")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-per-category", type=int, default=1)
    ap.add_argument("--busy", action="store_true", help="beside a busy loop on every core too")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    if args.bench_runs < 1:
        ap.error("--bench-runs must be at least 1")
    configs = [json.loads(text) for text in args.config] if args.config else [DEFAULT_CONFIG]

    write_report(args.out, vars(args), {"bench_spread": bench_spread(args, configs)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
