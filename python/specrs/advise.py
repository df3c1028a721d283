"""`specrs advise`: which speculation pays on your own prompts, measured on this machine.

    specrs advise [PROMPTS.jsonl] [--model PATH] [--methods ngram,suffix] [--config JSON ...]
                  [--max-k 8] [--max-tokens 128] [--temperature 0] [--num-prompts 20] [--repeats 3] [--json]

PROMPTS.jsonl holds one `{"prompt": "..."}` per line (or Spec-Bench's `turns`); each is sent as a
user message in the model's chat template unless `--no-chat`. Without it, the small prompt set
specrs ships (`specrs/data/prompts.jsonl`) is used: your own prompts say more. PROMPTS may instead be a
`specrs serve --record-traffic` directory: its requests run with the token ids they were served
with, and `--held-out 0.05` keeps only those `specrs train-head` held out from fine-tuning, so

    specrs advise DIR --held-out 0.05 --methods "" --config '{"method": "eagle3"}' \
        --config '{"method": "eagle3", "model": "FINE_TUNED_DIR"}'

measures a head's acceptance before and after fine-tuning on that traffic.

The decision rule:
1. Measure. Every prompt runs without speculation and with each candidate at a fixed k = max-k
   (adaptive length off, so every draft position is observed): ngram first (free, and it pays
   whenever outputs copy their prompts), then suffix, then the other methods and configs given.
   One process, interleaved prompt by prompt (see `specrs bench`).
2. Fit. For each candidate and each k <= max-k, the expected speedup with measured costs:
       S(k) = [(1 - f) + f (1 + r_1 + ... + r_k)] / [(1 - f) + f (v(k+1) + c(k))]
   f: share of decode steps that had a draft (a lookup finds no match in the others);
   r_i: per-position acceptance (drafts whose i-th token was accepted / drafts);
   v(n) = t(n)/t(1): the verification cost curve, measured now on this machine, read at
   min(k, mean draft length) + 1 (a lookup match is often shorter than k);
   c(k): the proposer's time per drafted token in target steps, times that length.
3. Confirm. Each candidate runs again on the same prompts beside a fresh baseline (a fresh engine,
   so suffix decoding does not start out knowing the answers), twice: at its best fixed k, and
   with specrs' default adaptive length up to max-k (which the fit cannot predict: it picks each
   draft's length from the acceptance seen so far), in `--repeats` passes (default 3), each on a
   fresh engine. A confirmed speedup is the median over the passes, with its min and max and the
   decode tokens behind it; one that never drafted, or that is above the tokens per step its
   drafts yielded (at most k + 1), is timing noise and never counts (specrs.speedup). The best
   measured speedup decides; speculation is recommended only when it measures at least
   MIN_SPEEDUP.

Warnings name what makes speculation not pay: low acceptance, few drafts, a high temperature.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Sequence

from . import bench
from .engine import Engine, SamplingParams, expected_speedup
from .errors import ConfigError

# Below this measured speedup the advice is to serve without speculation: a few percent is within
# the run-to-run noise of a shared machine and not worth a second code path.
MIN_SPEEDUP = 1.05
# Acceptance below this rarely pays even with a free proposer: each draft costs a wider verify.
LOW_ACCEPTANCE = 0.3
# At or above this temperature the target's choices spread out and drafts match less often.
HIGH_TEMPERATURE = 0.7
DEFAULT_METHODS = "ngram,suffix"


def predicted_speedup(k: int, draft_share: float, acceptance_per_pos: Sequence[float], verify_cost: Sequence[float],
                      draft_cost_per_token: float, mean_draft_length: float) -> float:
    """S(k) of the module docstring. A draft is min(k, mean_draft_length) tokens long (a lookup or
    suffix match is often shorter than k): that length sets the draft cost and the verify cost,
    read off `verify_cost` = [v(1), v(2), ...] (interpolated, as Engine.metrics does)."""
    f = draft_share
    length = min(k, mean_draft_length)
    tokens = (1 - f) + f * (1 + sum(acceptance_per_pos[:k]))
    # With acceptance 0 every step yields one token, so the expected speedup is exactly 1 / v(length + 1).
    verify = 1.0 / expected_speedup(0.0, length, verify_cost_ratio=list(verify_cost))
    time = (1 - f) + f * (verify + draft_cost_per_token * length)
    return tokens / time


def fit(agg: dict, baseline_itl_s: float, verify_cost: Sequence[float], max_k: int) -> dict:
    """The measured quantities of one candidate's fixed max-k run and S(k) for k = 1..max_k.
    `measured_speedup` is that single run's figure (`bench.summarize`'s speedup_stats), kept for
    the record; the confirmed runs' repeats decide."""
    drafts = agg["num_drafts"]
    f = drafts / agg["decode_steps"] if agg["decode_steps"] else 0.0
    mean_len = agg["num_draft_tokens"] / drafts if drafts else 0.0
    propose_s = (agg["time_breakdown"] or {}).get("propose_s", 0.0)
    c_per_token = propose_s / agg["num_draft_tokens"] / baseline_itl_s if agg["num_draft_tokens"] and baseline_itl_s else 0.0
    per_pos = agg["acceptance_rate_per_pos"]
    predicted = {k: predicted_speedup(k, f, per_pos, verify_cost, c_per_token, mean_len) for k in range(1, max_k + 1)}
    return {
        "acceptance_rate": agg["acceptance_rate"],
        "acceptance_rate_per_pos": per_pos,
        "mean_acceptance_length": agg["mean_acceptance_length"],
        "draft_share": f,
        "mean_draft_length": mean_len,
        "draft_cost_per_token": c_per_token,
        "measured_speedup": agg.get("speedup_stats"),
        "predicted_speedup": predicted,
        "best_k": max(predicted, key=predicted.get),
    }


def load_recording(path: str, held_out: float | None) -> list[dict]:
    """Requests of a `specrs serve --record-traffic` recording (its DIR or DIR/traffic.jsonl), as
    prompts of their served token ids. With `held_out`, only the requests `specrs train-head`
    holds out at that fraction, so a head fine-tuned on the rest is measured on unseen traffic."""
    from .serve.traffic import FILE_NAME
    from .train.features import conversations, held_out_every

    file = os.path.join(path, FILE_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ConfigError(f"{path} holds no {FILE_NAME}: pass a directory written by `specrs serve --record-traffic`")
    every = held_out_every(held_out) if held_out else None
    return [{"question_id": row.get("index", line), "category": "traffic", "orig_category": "traffic",
             "content": "", "token_ids": list(row["prompt_ids"]), "prompt_tokens": len(row["prompt_ids"]),
             "truncated": False}
            for line, row in enumerate(conversations(file)) if every is None or line % every == 0]


def is_recording(path: str) -> bool:
    """Whether `path` is a traffic recording (rows with prompt_ids) rather than a prompts file."""
    if os.path.isdir(path):
        return True
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and "prompt_ids" in row


def _candidates(methods: str, configs: list[str]) -> list[dict]:
    out = [{"method": m.strip()} for m in methods.split(",") if m.strip()]
    out += [bench.parse_config(text) for text in configs]
    if not out:
        raise ConfigError("no candidates: pass --methods (e.g. ngram,suffix) or --config JSON")
    return out


def _with_k(config: dict, k: int, adaptive: bool = False) -> dict:
    return {**config, "num_speculative_tokens": k, "adaptive_draft_length": adaptive}


def _run(engines: Sequence[Engine], prompts: list[dict], configs: list[dict], params: SamplingParams, greedy: bool,
         progress: bool) -> dict:
    """Every config (and the baseline) on every prompt, one pass per engine; the overall table."""
    records: list[dict] = []
    for repeat, engine in enumerate(engines):
        runners = [bench.specrs_runner(engine, None, params)] + [bench.specrs_runner(engine, c, params)
                                                                 for c in configs]
        bench.check_unique_labels(runners)
        records += bench.run_benchmark(prompts, runners, params.max_tokens, greedy=greedy, progress=progress,
                                       repeat=repeat, settle=engine.wait_for_costs)
    return bench.summarize(records, runners)["overall"]


def advise(prompts_path: str | None, model: str | None = None, methods: str = DEFAULT_METHODS, configs: list[str] = (),
           max_k: int = 8, max_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
           num_prompts: int | None = 20, chat: bool = True, device: str = "cpu", progress: bool = True,
           held_out: float | None = None, repeats: int = bench.DEFAULT_REPEATS) -> dict:
    """Runs the decision rule; returns the report (`format_report` prints it). `prompts_path` may
    be a traffic recording (then `held_out` picks the requests training held out), or None for the
    prompts specrs ships. `repeats`: passes of the confirming runs, each on a fresh engine."""
    if max_k < 1:
        raise ConfigError(f"--max-k must be at least 1 (got {max_k})")
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1 (got {repeats}); 3 or more give a spread")
    prompts_path = prompts_path or bench.SHIPPED_PROMPTS
    candidates = _candidates(methods, list(configs))
    if not os.path.exists(prompts_path):
        raise ConfigError(f"{prompts_path} does not exist: pass a JSONL of prompts or a --record-traffic directory")
    recording = is_recording(prompts_path)
    if held_out is not None and not recording:
        raise ConfigError("--held-out picks requests of a traffic recording; pass a --record-traffic directory")
    prompts = (load_recording(prompts_path, held_out) if recording else bench.load_prompts(prompts_path))[:num_prompts]
    if not prompts:
        raise ConfigError(f"no prompts in {prompts_path}")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                            seed=seed if temperature > 0 else None)
    greedy = temperature == 0

    engine = Engine(model, device=device)
    if not recording:  # a recording holds the token ids as served, template included
        prompts = bench.tokenize_prompts(engine, prompts, max_tokens, chat)
    measured = _run([engine], prompts, [_with_k(c, max_k) for c in candidates], params, greedy, progress)
    baseline = measured[bench.BASELINE_LABEL]
    context = int(sum(p["prompt_tokens"] for p in prompts) / len(prompts) + max_tokens / 2)
    verify_cost = engine.verify_cost_ratios(max_k + 1, context)

    report_candidates = []
    for config in candidates:
        agg = measured[bench.config_label(_with_k(config, max_k))]
        report_candidates.append({"config": config, **fit(agg, baseline["itl_s_mean"], verify_cost, max_k)})

    # Confirm each candidate at its best fixed k and adaptive, `repeats` times, each on a fresh
    # engine (fresh suffix caches).
    runs = [(c, _with_k(c["config"], c["best_k"]), c["predicted_speedup"][c["best_k"]]) for c in report_candidates]
    runs += [(c, _with_k(c["config"], max_k, adaptive=True), None) for c in report_candidates]
    fresh = (Engine(model, device=device) for _ in range(repeats))
    confirmed = _run(list(fresh), prompts, [config for _, config, _ in runs], params, greedy, progress)
    for candidate, config, predicted in runs:
        agg = confirmed[bench.config_label(config)]
        candidate.setdefault("confirmed", []).append({
            "speculative_config": config, "predicted_speedup": predicted, "speedup": agg["speedup"],
            "speedup_stats": agg["speedup_stats"], "acceptance_rate": agg["acceptance_rate"],
            "mean_acceptance_length": agg["mean_acceptance_length"], "matches_baseline": agg["num_matching_baseline"]})

    return {
        "prompts": prompts_path,
        "num_prompts": len(prompts),
        "model": engine.model_path,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "max_k": max_k,
        "repeats": repeats,
        "verify_cost_ratios": verify_cost,
        "verify_context_tokens": context,
        "baseline_decode_tokens_per_s": baseline["decode_tokens_per_s"],
        "candidates": report_candidates,
        **recommend(report_candidates, temperature),
    }


def recommend(candidates: list[dict], temperature: float) -> dict:
    """The recommendation and its reason, and the warnings, from the fitted and confirmed candidates.
    Only a confirmed run whose figure is a speedup (`speedup` not None: it drafted, and it is within
    what its drafts can reach) counts; the best median decides."""
    confirmed = [(c, run) for c in candidates for run in c["confirmed"]]
    best, run = max(confirmed, key=lambda cr: cr[1]["speedup"] if cr[1]["speedup"] is not None else -1.0)
    config = run["speculative_config"]
    name, k, measured, predicted = config["method"], config["num_speculative_tokens"], run["speedup"], \
        run["predicted_speedup"]
    what = f"{name} at {'adaptive length up to ' if config['adaptive_draft_length'] else ''}k={k}"
    predicted_text = "not predicted: the fit covers fixed k" if predicted is None else f"predicted {predicted:.2f}x"
    measured_text = _measured_text(run)
    warnings = []
    if temperature >= HIGH_TEMPERATURE:
        warnings.append(f"temperature {temperature:g} is high: sampled tokens spread out and match drafts less "
                        "often; these numbers hold at this temperature only")
    for c in candidates:
        method = c["config"]["method"]
        if c["acceptance_rate"] < LOW_ACCEPTANCE:
            warnings.append(f"{method}: low acceptance ({c['acceptance_rate']:.0%} of draft tokens at k={len(c['acceptance_rate_per_pos'])}); "
                            "most drafted tokens are rejected and each costs a wider verification")
        if c["draft_share"] < 0.2:
            warnings.append(f"{method}: drafted in only {c['draft_share']:.0%} of decode steps; these outputs rarely "
                            "repeat their prompts or earlier outputs")
    noise = [r for _, r in confirmed if r["speedup"] is None and r.get("speedup_stats")]
    for r in noise:
        warnings.append(f"{bench.config_label(r['speculative_config'])}: {r['speedup_stats']['text']}")
    if measured is not None and measured >= MIN_SPEEDUP:
        reason = (f"{what} measured {measured_text} over plain decoding on these prompts ({predicted_text}; at "
                  f"k={len(best['acceptance_rate_per_pos'])} it accepted {best['acceptance_rate']:.0%} of draft tokens "
                  f"and drafted in {best['draft_share']:.0%} of steps; verify and draft costs measured here)")
        recommendation = {"speculative_config": config, "method": name, "k": k,
                          "predicted_speedup": predicted, "measured_speedup": measured, "reason": reason}
    else:
        if measured is None:
            reason = ("no candidate measured a speedup: every confirmed figure was timing noise (no drafts, or above "
                      "what its drafts can reach); serve without speculation, or measure again on a quieter machine")
        else:
            reason = (f"no candidate pays: the best, {what}, measured {measured_text} ({predicted_text}), under the "
                      f"{MIN_SPEEDUP:.2f}x this advice requires; serve without speculation")
        warnings.append("speculation does not pay on these prompts on this machine")
        recommendation = {"speculative_config": None, "method": None, "k": None, "predicted_speedup": predicted,
                          "measured_speedup": measured, "reason": reason, "best_candidate": config}
    return {"recommendation": recommendation, "warnings": warnings}


def _measured_text(run: dict) -> str:
    """A confirmed run's figure with its spread and tokens (`specrs.speedup`), or its bare value."""
    stats = run.get("speedup_stats")
    return stats["text"] if stats is not None else bench.fmt(run["speedup"], ".2f", "x")


def format_report(report: dict) -> str:
    lines = [f"specrs advise: {report['num_prompts']} prompts from {report['prompts']}, {report['max_tokens']} tokens, "
             f"temperature {report['temperature']:g}; baseline {report['baseline_decode_tokens_per_s']:.1f} tok/s decode",
             "verify cost v(n) = t(n)/t(1): " + " ".join(f"{n}:{v:.2f}" for n, v in
                                                         enumerate(report["verify_cost_ratios"], 1)), "",
             f"| method | acc. rate (k={report['max_k']}) | per position | drafts in steps | c per token | "
             f"best k | predicted | measured at best k | measured adaptive |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in report["candidates"]:
        k = c["best_k"]
        per_pos = " ".join(f"{r:.2f}" for r in c["acceptance_rate_per_pos"])
        fixed, adaptive = c["confirmed"]
        lines.append(f"| {bench.config_label(c['config'])} | {c['acceptance_rate']:.2f} | {per_pos} | "
                     f"{c['draft_share']:.0%} | {c['draft_cost_per_token']:.3f} | {k} | "
                     f"{c['predicted_speedup'][k]:.2f}x | {bench.format_speedup(fixed)} | "
                     f"{bench.format_speedup(adaptive)} |")
    lines += ["", f"Measured: median (min-max) over {report.get('repeats', 1)} runs on fresh engines; "
              "'noise' marks a figure above the tokens per step its drafts yielded (at most k + 1)."]
    rec = report["recommendation"]
    lines += ["", "Recommendation: " + (json.dumps(rec["speculative_config"]) if rec["speculative_config"]
                                        else "no speculation"), f"  because {rec['reason']}"]
    lines += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="?", default=None,
                        help='JSONL of prompts: {"prompt": "..."} per line (or Spec-Bench\'s shape), or a '
                        "`specrs serve --record-traffic` directory (its requests as served); default: the small set "
                        "specrs ships")
    parser.add_argument("--held-out", type=float, default=None, metavar="FRACTION",
                        help="with a recording: only the requests `specrs train-head` held out at this fraction "
                             "(its --held-out, default 0.05), to compare heads before and after fine-tuning on the rest")
    parser.add_argument("--model", default=None, help="path of a .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="comma list of methods measured with their defaults, in this order (default: ngram,suffix)")
    parser.add_argument("--config", action="append", default=[], metavar="JSON",
                        help="another candidate, vLLM's --speculative-config format (e.g. a draft_model); repeatable")
    parser.add_argument("--max-k", type=int, default=8, help="largest num_speculative_tokens considered")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="measure at your traffic's temperature")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=20, help="the first N prompts of the file")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap each prompt in the model's chat template (default on)")
    parser.add_argument("--repeats", type=int, default=bench.DEFAULT_REPEATS,
                        help="passes of the confirming runs, each on a fresh engine; a speedup is their median "
                             f"with its min-max (default: {bench.DEFAULT_REPEATS})")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_from_args(args: argparse.Namespace) -> int:
    report = advise(args.prompts, args.model, args.methods, args.config, args.max_k, args.max_tokens,
                    args.temperature, args.seed, args.num_prompts, args.chat, args.device, not args.no_progress,
                    args.held_out, args.repeats)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0
