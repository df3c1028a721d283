"""Hidden-state heads' cost on the CPU: c, the drafting time per draft token over one target
decode step, for each head method (EAGLE-1, EAGLE-3 with an 8k and a 32k draft vocabulary, MTP,
MLP speculator, Medusa; EAGLE and MTP also with their linear weights quantized to Q8_0 at load)
with SmolLM2-shaped random heads on SmolLM2-135M (tests/head_writer.py),
beside plain decoding of the same prompts in the same process; then the expected speedup those
costs imply at acceptance 0.5 / 0.7 / 0.9 with the engine's measured verification curve.

Each prompt (Spec-Bench, chat template, greedy, fixed k = 3, so every draft is k tokens) runs
plain, then with each head, in turn; t(1) is plain decoding's forward seconds per step on that
prompt, and c = (proposer seconds / draft tokens) / t(1) on the same prompt. A head step reads
the target's hidden rows of the tokens the last step kept (one or more), runs its layer(s), and
drafts k tokens autoregressively (EAGLE, MTP) or one per sub-head (MLP speculator, Medusa).
Random heads are rejected almost always, so the acceptance here says nothing; trained heads
belong to the issue on heads we train ourselves.

    python benches/head_cost_bench.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --out bench-results/head_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import specrs
from specrs import SamplingParams, bench

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from head_writer import write_eagle, write_eagle3, write_medusa, write_mlp_speculator, write_mtp_gguf  # noqa: E402
from spec_bench import select_prompts  # noqa: E402

K = 3
ACCEPTANCE = [0.5, 0.7, 0.9]


def heads(d: Path) -> dict[str, dict]:
    return {
        "eagle": {"method": "eagle", "model": str(write_eagle(d / "eagle"))},
        "eagle (q8_0)": {"method": "eagle", "model": str(d / "eagle"), "quantization": "q8_0"},
        "eagle3 (8k vocab)": {"method": "eagle3", "model": str(write_eagle3(d / "eagle3_8k", draft_vocab=8192))},
        "eagle3 (32k vocab)": {"method": "eagle3", "model": str(write_eagle3(d / "eagle3_32k", draft_vocab=32768))},
        "eagle3 (8k vocab, q8_0)": {"method": "eagle3", "model": str(d / "eagle3_8k"), "quantization": "q8_0"},
        "mtp": {"method": "mtp", "model": str(write_mtp_gguf(d / "mtp.gguf"))},
        "mtp (q8_0)": {"method": "mtp", "model": str(d / "mtp.gguf"), "quantization": "q8_0"},
        "mlp_speculator": {"method": "mlp_speculator", "model": str(write_mlp_speculator(d / "mlp"))},
        "medusa": {"method": "medusa", "model": str(write_medusa(d / "medusa"))},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="Spec-Bench question.jsonl")
    parser.add_argument("--num-per-category", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="bench-results/head_cost.json")
    args = parser.parse_args()

    engine = specrs.Engine()
    prompts = bench.tokenize_prompts(engine, select_prompts(args.prompts, args.num_per_category, "spread"),
                                     args.max_tokens, chat=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        configs = {name: {**c, "num_speculative_tokens": K, "adaptive_draft_length": False}
                   for name, c in heads(Path(tmp)).items()}
        for config in configs.values():
            engine.prepare(config)  # weights loaded outside the timed runs
        costs: dict[str, list[float]] = {name: [] for name in configs}
        step_ms: list[float] = []
        for _ in range(args.rounds):
            for p in prompts:
                plain = engine.generate(p["token_ids"], params, speculative_config=False).metrics
                t1 = plain["forward_s"] / plain["num_decode_steps"]
                step_ms.append(1e3 * t1)
                for name, config in configs.items():
                    m = engine.generate(p["token_ids"], params, speculative_config=config).metrics
                    costs[name].append(m["propose_s"] / m["num_draft_tokens"] / t1)
        curve = engine.verify_cost_ratios(2 * K + 2, 512)

    rows = {}
    for name, cs in costs.items():
        c = statistics.median(cs)
        best = {a: max((specrs.expected_speedup(a, k, c, curve), k) for k in range(1, 2 * K + 1)) for a in ACCEPTANCE}
        rows[name] = {
            "draft_cost_per_token": c,
            "draft_cost_min": min(cs),
            "draft_cost_max": max(cs),
            "expected_speedup_k3": {str(a): specrs.expected_speedup(a, K, c, curve) for a in ACCEPTANCE},
            "best_k": {str(a): {"k": k, "expected_speedup": s} for a, (s, k) in best.items()},
        }
    report = {
        "machine": bench.machine_info(),
        "model": engine.model_path,
        "num_prompts": len(prompts),
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "k": K,
        "target_step_ms_median": statistics.median(step_ms),
        "verify_cost_ratios": curve,
        "heads": rows,
    }
    bench.write_json(args.out, report)

    print(f"target step t(1): {report['target_step_ms_median']:.1f} ms (median of {len(step_ms)} prompts x rounds); "
          f"v(n) = {', '.join(f'{v:.2f}' for v in curve)}")
    header = "| head | c per draft token (min-max) | " + " | ".join(f"a={a}: k=3 / best k" for a in ACCEPTANCE) + " |"
    print(header)
    print("|" + "---|" * (2 + len(ACCEPTANCE)))
    for name, r in rows.items():
        cells = [f"{r['expected_speedup_k3'][str(a)]:.2f}x / {r['best_k'][str(a)]['expected_speedup']:.2f}x "
                 f"(k={r['best_k'][str(a)]['k']})" for a in ACCEPTANCE]
        print(f"| {name} | {r['draft_cost_per_token']:.3f} ({r['draft_cost_min']:.3f}-{r['draft_cost_max']:.3f}) | "
              + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
