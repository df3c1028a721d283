"""Hidden-state heads' cost on the CPU: c, the drafting time per draft token over one target
decode step, for each head method (EAGLE-1, EAGLE-3 with an 8k and a 32k draft vocabulary, MTP,
MLP speculator, Medusa, DFlash block drafters of 1 and 5 layers; some also with their linear
weights quantized to Q8_0 at load) with random heads shaped for the target (tests/head_writer.py;
SmolLM2-135M, or Qwen2.5-Coder-1.5B with --model), beside plain decoding of the same prompts in
the same process; then the expected speedup those costs imply at acceptance 0.5 / 0.7 / 0.9 with
the engine's measured verification curve.

Each prompt (Spec-Bench, chat template, greedy, fixed k = 3, so every draft is k tokens) runs
plain, then with each head, in turn; t(1) is plain decoding's forward seconds per step on that
prompt, and c = (proposer seconds / draft tokens) / t(1) on the same prompt. A head step reads
the target's hidden rows of the tokens the last step kept (one or more), runs its layer(s), and
drafts k tokens autoregressively (EAGLE, MTP) or one per sub-head (MLP speculator, Medusa); a
DFlash drafter runs one forward over its whole block (16 rows) whatever k is, so it is also timed
at k = 15 (its block's drafts) and reported per block (proposer seconds / drafts / t(1)).
Random heads are rejected almost always, so the acceptance here says nothing; trained heads
belong to the issue on heads we train ourselves.

    python benches/head_cost_bench.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --out bench-results/head_cost.json
    python benches/head_cost_bench.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --model qwen2.5-coder-1.5b --heads eagle3 dflash --out bench-results/head_cost_qwen1.5b.json
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
from head_writer import (  # noqa: E402
    SMOLLM2,
    write_dflash,
    write_eagle,
    write_eagle3,
    write_medusa,
    write_mlp_speculator,
    write_mtp_gguf,
)
from spec_bench import select_prompts  # noqa: E402

K = 3
BLOCK = 16  # DFlash's published drafters' block (z-lab's *-b16): the newest token and 15 drafts
ACCEPTANCE = [0.5, 0.7, 0.9]
# The targets' shapes (their GGUF metadata), for heads that fit them.
SHAPES = {
    "smollm2-135m": SMOLLM2,
    "qwen2.5-coder-1.5b": dict(hidden=1536, heads=12, kv_heads=2, head_dim=128, ffn=8960, vocab=151936, layers=28,
                               rope_theta=1e6),
}


def heads(d: Path, s: dict) -> dict[str, dict]:
    """name -> a function writing the head (once) and giving its config (with its own
    "num_speculative_tokens" where it is not K)."""

    def once(path: Path, write) -> str:
        return str(path if path.exists() else write(path))

    def eagle() -> str:
        return once(d / "eagle", lambda p: write_eagle(p, s))

    def eagle3() -> str:
        return once(d / "eagle3_8k", lambda p: write_eagle3(p, s))

    def mtp() -> str:
        return once(d / "mtp.gguf", lambda p: write_mtp_gguf(p, s))

    def dflash(num_layers: int) -> str:
        return once(d / f"dflash{num_layers}", lambda p: write_dflash(p, s, num_layers=num_layers, block_size=BLOCK))

    lazy = {
        "eagle": lambda: {"method": "eagle", "model": eagle()},
        "eagle (q8_0)": lambda: {"method": "eagle", "model": eagle(), "quantization": "q8_0"},
        "eagle3 (8k vocab)": lambda: {"method": "eagle3", "model": eagle3()},
        "eagle3 (32k vocab)": lambda: {"method": "eagle3", "model": once(
            d / "eagle3_32k", lambda p: write_eagle3(p, s, draft_vocab=32768))},
        "eagle3 (8k vocab, q8_0)": lambda: {"method": "eagle3", "model": eagle3(), "quantization": "q8_0"},
        "mtp": lambda: {"method": "mtp", "model": mtp()},
        "mtp (q8_0)": lambda: {"method": "mtp", "model": mtp(), "quantization": "q8_0"},
        "mlp_speculator": lambda: {"method": "mlp_speculator", "model": str(write_mlp_speculator(d / "mlp", s))},
        "medusa": lambda: {"method": "medusa", "model": str(write_medusa(d / "medusa", s))},
        "dflash 1 layer": lambda: {"method": "dflash", "model": dflash(1)},
        f"dflash 1 layer, k = {BLOCK - 1}": lambda: {"method": "dflash", "model": dflash(1),
                                                     "num_speculative_tokens": BLOCK - 1},
        f"dflash 1 layer (q8_0), k = {BLOCK - 1}": lambda: {"method": "dflash", "model": dflash(1),
                                                            "quantization": "q8_0", "num_speculative_tokens": BLOCK - 1},
        f"dflash 5 layers (q8_0), k = {BLOCK - 1}": lambda: {"method": "dflash", "model": dflash(5),
                                                             "quantization": "q8_0", "num_speculative_tokens": BLOCK - 1},
    }
    return lazy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="Spec-Bench question.jsonl")
    parser.add_argument("--num-per-category", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m", choices=list(SHAPES),
                        help="the target; heads are written in its shape")
    parser.add_argument("--heads", nargs="*", default=None,
                        help="only the heads whose name starts with one of these (e.g. eagle3 dflash)")
    parser.add_argument("--out", default="bench-results/head_cost.json")
    args = parser.parse_args()

    engine = specrs.Engine(args.model)
    prompts = bench.tokenize_prompts(engine, select_prompts(args.prompts, args.num_per_category, "spread"),
                                     args.max_tokens, chat=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        wanted = {name: make for name, make in heads(Path(tmp), SHAPES[args.model]).items()
                  if args.heads is None or any(name.startswith(h) for h in args.heads)}
        configs = {name: {"num_speculative_tokens": K, **make(), "adaptive_draft_length": False}
                   for name, make in wanted.items()}
        for config in configs.values():
            engine.prepare(config)  # weights loaded outside the timed runs
        costs: dict[str, list[float]] = {name: [] for name in configs}
        block_costs: dict[str, list[float]] = {name: [] for name in configs}
        step_ms: list[float] = []
        for _ in range(args.rounds):
            for p in prompts:
                plain = engine.generate(p["token_ids"], params, speculative_config=False).metrics
                t1 = plain["forward_s"] / plain["num_decode_steps"]
                step_ms.append(1e3 * t1)
                for name, config in configs.items():
                    m = engine.generate(p["token_ids"], params, speculative_config=config).metrics
                    costs[name].append(m["propose_s"] / m["num_draft_tokens"] / t1)
                    block_costs[name].append(m["propose_s"] / m["num_drafts"] / t1)
        longest = max(c["num_speculative_tokens"] for c in configs.values())
        curve = engine.verify_cost_ratios(max(2 * K, longest) + 2, 512)

    rows = {}
    for name, cs in costs.items():
        c = statistics.median(cs)
        c_draft = statistics.median(block_costs[name])
        # expected_speedup's c is a whole draft's cost over t(1): k * c for a head that drafts
        # token by token, one block's cost for a DFlash drafter whatever k verifies of it.
        if configs[name]["method"] == "dflash":
            ks, cost_at = range(1, BLOCK), (lambda k: c_draft)
        else:
            ks, cost_at = range(1, 2 * K + 1), (lambda k: k * c)
        speedup = lambda a, k: specrs.expected_speedup(a, k, cost_at(k), curve)  # noqa: E731
        best = {a: max((speedup(a, k), k) for k in ks) for a in ACCEPTANCE}
        rows[name] = {
            "k": configs[name]["num_speculative_tokens"],
            "draft_cost_per_draft": c_draft,
            "draft_cost_per_token": c,
            "draft_cost_min": min(cs),
            "draft_cost_max": max(cs),
            "expected_speedup_k3": {str(a): speedup(a, K) for a in ACCEPTANCE},
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
    header = ("| head | k | c per draft (block) | c per draft token (min-max) | "
              + " | ".join(f"a={a}: k=3 / best k" for a in ACCEPTANCE) + " |")
    print(header)
    print("|" + "---|" * (4 + len(ACCEPTANCE)))
    for name, r in rows.items():
        cells = [f"{r['expected_speedup_k3'][str(a)]:.2f}x / {r['best_k'][str(a)]['expected_speedup']:.2f}x "
                 f"(k={r['best_k'][str(a)]['k']})" for a in ACCEPTANCE]
        print(f"| {name} | {r['k']} | {r['draft_cost_per_draft']:.3f} | {r['draft_cost_per_token']:.3f} "
              f"({r['draft_cost_min']:.3f}-{r['draft_cost_max']:.3f}) | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
