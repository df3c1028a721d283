"""`specrs bench`: speculative decoding against plain decoding on a JSONL file of prompts.

    specrs bench --config '{"method": "ngram", "num_speculative_tokens": 4}'     # the prompts specrs ships
    specrs bench --prompts ../shared/data/spec_bench/question.jsonl --num-per-category 5 \\
        --config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}' \\
        --config '{"method": "suffix", "num_speculative_tokens": 4}' --json bench-results/bench.json

How it measures:
- Prompts: one JSON object per line in Spec-Bench's shape (`question_id`, `category`, `turns`); the
  first turn of each is the prompt, wrapped in the model's chat template unless `--no-chat`.
  Without `--prompts`, the small set shipped inside the package (`specrs/data/prompts.jsonl`:
  writing, code, summarization, extraction, rewriting, math, translation, QA).
- Truncation (`truncate_content`), as in the anchor harness (shared/anchors/common.py): when the
  prompt plus `--max-tokens` does not fit in `--max-context` tokens, the user text is cut to its
  longest character prefix that fits, so the chat template stays intact. Each record says whether
  its prompt was cut.
- One process, one Engine. The baseline (no speculation) always runs, and every configuration runs
  on every prompt before the next prompt starts, in an order rotated per prompt, so machine drift
  and warm caches affect all configurations alike. One unrecorded warm-up pass runs first, then
  the engine's cost measurements are waited for (so every recorded request reads the same
  adaptive-length figures).
- Repeats (`--repeats`, default 3): the whole pass runs again, each time on a fresh engine (suffix
  decoding caches responses across requests, and a repeat must not find the answers there). Every
  speedup is the median over the repeats with its min and max, beside the decode tokens behind it,
  and is printed as a speedup only when it is one (specrs.speedup): a configuration that never
  drafted, or a figure above the tokens per step its drafts yielded (at most k + 1), is timing
  noise and printed as such.
- Decode tokens/s is (n - 1) / (last token time - first token time): TTFT is excluded. Category
  and overall figures are ratios of sums (all decode tokens / all decode seconds), and the speedup
  is a configuration's decode tokens/s over the baseline's on the same prompts.
- Expected speedups beside the measured one: the textbook formula (draft cost c, verification
  priced like one forward) and the refined one (verification priced by the measured v(k+1) =
  t(k+1)/t(1) of `Engine.verify_cost_ratios`), both at the measured acceptance rate and mean
  draft length k (see `expected_speedups`).

`benches/spec_bench.py` reuses these functions and adds llama-cpp-python to the same run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from . import _specrs, extras
from .engine import Engine, SamplingParams
from .errors import ConfigError
from .speedup import ABOVE_CEILING, NO_DRAFTS, SPEEDUP, Speedup

# The prompts `specrs bench` and `specrs advise` run without --prompts: shipped in the package.
SHIPPED_PROMPTS = os.path.join(os.path.dirname(__file__), "data", "prompts.jsonl")
DEFAULT_REPEATS = 3

# Prompt + generated tokens must fit here; 2048 is the n_ctx the anchor harness gave llama.cpp.
DEFAULT_MAX_CONTEXT = 2048
BASELINE_LABEL = "baseline"

# Short names for config keys in labels, e.g. "ngram k=4 min=2 max=4".
_LABEL_KEYS = {
    "prompt_lookup_min": "min",
    "prompt_lookup_max": "max",
    "suffix_decoding_max_tree_depth": "depth",
    "suffix_decoding_max_cached_requests": "cache",
    "suffix_decoding_max_spec_factor": "factor",
    "suffix_decoding_min_token_prob": "min_prob",
    "adaptive_draft_length": "adaptive",
    "num_speculative_tokens_schedule": "schedule",
    "draft_confidence_threshold": "threshold",
    "mask_token_id": "mask",
    "exit_layer": "exit",
    "tree_depth": "tree_depth",
    "tree_top_k": "top_k",
    "speculative_token_tree": "static_tree",
}


# ---------------------------------------------------------------------------------------------
# Prompts


def load_prompts(
    path: str | os.PathLike,
    categories: Sequence[str] | None = None,
    num_per_category: int | None = None,
    groups: dict[str, Sequence[str]] | None = None,
) -> list[dict]:
    """Prompts of a JSONL file, in file order within each category: Spec-Bench's shape
    (`question_id`, `category`, `turns`: the first turn is the prompt) or simply `{"prompt": ...}`
    per line (category "all" unless given).

    `groups` maps a reported category name to the file categories it collects (the anchor harness
    reports the eight MT-bench categories as one "mt_bench"); without it every file category is
    its own group, in order of first appearance. `categories` keeps only these reported names.
    Returns dicts with question_id, category (reported), orig_category and content.
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{line_no}: not valid JSON ({e})") from None
            content = None
            if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
                content = row["turns"][0]
            elif isinstance(row, dict):
                content = row.get("prompt")
            if not isinstance(content, str) or not content:
                raise ConfigError(f"{path}:{line_no}: each line needs a non-empty 'prompt' string or, as in "
                                  "Spec-Bench, a non-empty 'turns' list")
            row = dict(row, content=content, category=row.get("category", "all"))
            rows.append(row)
    if groups is None:
        groups = {}
        for row in rows:
            groups.setdefault(row["category"], [row["category"]])
    if categories:
        unknown = [c for c in categories if c not in groups]
        if unknown:
            raise ConfigError(f"unknown categories {unknown}; {path} has: {', '.join(groups)}")
        groups = {name: groups[name] for name in categories}
    prompts = []
    for name, members in groups.items():
        selected = [r for r in rows if r["category"] in members]
        for row in selected[:num_per_category]:
            prompts.append({
                "question_id": row.get("question_id"),
                "category": name,
                "orig_category": row["category"],
                "content": row["content"],
            })
    return prompts


def truncate_content(
    content: str, tokenize: Callable[[str], list[int]], max_tokens: int, max_context: int
) -> tuple[str, list[int], bool]:
    """(content, prompt token ids, was_cut) with len(ids) + max_tokens <= max_context.

    `tokenize` turns user content into the full prompt's ids (template included). Cutting whole
    characters, not token ids, gives every engine with the same tokenizer the same text
    (shared/anchors/common.py, truncate_prompt).
    """
    limit = max_context - max_tokens
    ids = tokenize(content)
    if len(ids) <= limit:
        return content, ids, False
    fits, too_long = 0, len(content)  # invariant: content[:fits] fits, content[:too_long] does not
    while too_long - fits > 1:
        middle = (fits + too_long) // 2
        if len(tokenize(content[:middle])) <= limit:
            fits = middle
        else:
            too_long = middle
    content = content[:fits]
    ids = tokenize(content)
    if len(ids) > limit:
        raise ConfigError(f"the prompt template alone needs {len(ids)} tokens; raise --max-context")
    return content, ids, True


def tokenize_prompts(engine: Engine, prompts: list[dict], max_tokens: int, chat: bool,
                     max_context: int = DEFAULT_MAX_CONTEXT) -> list[dict]:
    """Adds token_ids, prompt_tokens and truncated to each prompt (cut to fit, see above)."""
    max_context = min(max_context, engine.info()["context_length"])

    def tokenize(content: str) -> list[int]:
        if chat:
            return engine.prompt_token_ids([{"role": "user", "content": content}])
        return engine.prompt_token_ids(content)

    for p in prompts:
        p["content"], p["token_ids"], p["truncated"] = truncate_content(p["content"], tokenize, max_tokens, max_context)
        p["prompt_tokens"] = len(p["token_ids"])
    return prompts


# ---------------------------------------------------------------------------------------------
# Configurations and runners


def parse_config(text: str) -> dict:
    """A speculative config from its JSON text (vLLM's --speculative-config format)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--config {text!r} is not valid JSON ({e}); "
                          'example: \'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
    if not isinstance(config, dict) or "method" not in config:
        raise ConfigError(f"--config {text!r} must be a JSON object with a 'method' key")
    return config


def config_label(config: dict | None) -> str:
    """A short readable name: "baseline", "ngram k=4 min=2 max=4", "suffix k=8"."""
    if not config:
        return BASELINE_LABEL
    parts = [str(config["method"])]
    if "num_speculative_tokens" in config:
        parts.append(f"k={config['num_speculative_tokens']}")
    for key, value in config.items():
        if key not in ("method", "num_speculative_tokens"):
            value = os.path.basename(value) if key == "model" else value  # a path: its file name
            parts.append(f"{_LABEL_KEYS.get(key, key)}={value}")
    return " ".join(parts)


@dataclass
class Runner:
    """One configuration to benchmark: `run(prompt, max_tokens)` generates from prompt["token_ids"]
    and returns (metrics dict in specrs's schema, generated token ids, finish reason)."""

    label: str
    engine_name: str  # "specrs", or "llama.cpp" in benches/spec_bench.py
    run: Callable[[dict, int], tuple[dict, list[int], str | None]]
    is_baseline: bool = False  # speedups of this engine's other runners are relative to this one
    num_speculative_tokens: int = 0


def specrs_runner(engine: Engine, config: dict | None, params: SamplingParams) -> Runner:
    """Runs `config` on `engine` (None: the baseline, speculation explicitly off)."""
    spec = config if config else False

    def run(prompt: dict, max_tokens: int):
        p = params if max_tokens == params.max_tokens else _with_max_tokens(params, max_tokens)
        out = engine.generate(prompt["token_ids"], p, speculative_config=spec)
        return out.metrics, out.token_ids, out.finish_reason

    k = config.get("num_speculative_tokens", 0) if config else 0
    k = k if isinstance(k, int) and k > 0 else 0  # a bad value is the engine's to reject, with its message
    return Runner(config_label(config), "specrs", run, is_baseline=not config, num_speculative_tokens=k)


def check_unique_labels(runners: list[Runner]) -> None:
    """Records are keyed by label, so two runners may not share one."""
    labels = [r.label for r in runners]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ConfigError(f"configurations given twice: {repeated}")


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p, min_p=params.min_p, seed=params.seed, ignore_eos=params.ignore_eos)


class ProgressBar:
    """A one-line progress bar on stderr; when stderr is not a terminal (a log file), a line every
    `line_every` steps instead."""

    def __init__(self, total: int, enabled: bool = True, width: int = 28, line_every: int = 1):
        self.total, self.enabled, self.width, self.line_every = total, enabled, width, line_every
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled or (not self.tty and done % self.line_every and done != self.total):
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        filled = self.width * done // max(self.total, 1)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} "
                f"{_clock(elapsed)} elapsed, {_clock(eta)} left  {note}")
        if self.tty:
            sys.stderr.write("\r" + line[:150].ljust(150))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


def run_benchmark(prompts: list[dict], runners: list[Runner], max_tokens: int, greedy: bool,
                  progress: bool = True, warmup_tokens: int = 8, repeat: int = 0,
                  settle: Callable[[], Any] | None = None) -> list[dict]:
    """Every runner on every prompt; returns one record per (prompt, runner), marked `repeat`.

    The runners of one prompt all finish before the next prompt starts, and their order rotates
    by one per prompt, so slow drift of the machine and order effects spread over all of them.
    A warm-up pass (every runner, `warmup_tokens` tokens, not recorded) goes first: it also
    rejects a bad configuration before any time is spent. It continues only the first 16 tokens
    of the first prompt (the chat template's preamble): suffix decoding keeps every response in a
    cache shared by later requests of the same config, and the warm-up must not hand it the
    answer to a measured prompt. `settle()` runs after it (the engine's `wait_for_costs`, so
    every recorded request reads the cost figures the warm-up queued, measured).
    """
    warmup_prompt = dict(prompts[0], token_ids=prompts[0]["token_ids"][:16])
    for runner in runners:
        runner.run(warmup_prompt, warmup_tokens)
    if settle is not None:
        settle()
    bar = ProgressBar(len(prompts) * len(runners), enabled=progress, line_every=len(runners))
    records = []
    for i, prompt in enumerate(prompts):
        shift = i % len(runners)
        outputs = {}
        for j, runner in enumerate(runners[shift:] + runners[:shift]):
            bar.update(i * len(runners) + j, f"{prompt['category']} q{prompt['question_id']} {runner.label}")
            metrics, token_ids, finish_reason = runner.run(prompt, max_tokens)
            outputs[runner.label] = token_ids
            records.append({
                "repeat": repeat,
                "question_id": prompt["question_id"],
                "category": prompt["category"],
                "orig_category": prompt["orig_category"],
                "prompt_tokens": prompt["prompt_tokens"],
                "truncated": prompt["truncated"],
                "engine": runner.engine_name,
                "config": runner.label,
                "finish_reason": finish_reason,
                "output_sha": hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16],
                "metrics": dict(metrics),
            })
        # Greedy speculative decoding must reproduce the engine's own plain greedy output.
        for record in records[-len(runners):]:
            base = next((r.label for r in runners if r.is_baseline and r.engine_name == record["engine"]), None)
            same = outputs[record["config"]] == outputs[base] if base is not None else None
            record["matches_baseline"] = same if greedy else None
    bar.update(len(prompts) * len(runners), "done")
    bar.close()
    return records


# ---------------------------------------------------------------------------------------------
# Aggregation


def aggregate(metrics_list: list[dict], num_speculative_tokens: int = 0) -> dict:
    """Ratio-of-sums figures over some requests of one configuration."""
    def total(key):
        return sum(m.get(key) or 0 for m in metrics_list)

    generated = total("num_generated_tokens")
    gaps = sum(max(m["num_generated_tokens"] - 1, 0) for m in metrics_list)  # tokens after the first
    decode_s = sum(m["e2e_s"] - m["ttft_s"] for m in metrics_list if m["num_generated_tokens"] > 1)
    forwards = total("num_forward_passes")
    # Decode steps (one target forward each, with or without a draft); without the count, every
    # forward after the prefill's one is a step.
    decode_steps = sum(m.get("num_decode_steps", max(m["num_forward_passes"] - 1, 0)) for m in metrics_list)
    drafts, draft_tokens, accepted = total("num_drafts"), total("num_draft_tokens"), total("num_accepted_tokens")
    per_pos = [0] * num_speculative_tokens
    for m in metrics_list:
        for i, count in enumerate(m.get("num_accepted_tokens_per_pos") or []):
            if i >= len(per_pos):
                per_pos.append(0)
            per_pos[i] += count
    out = {
        "num_requests": len(metrics_list),
        "num_generated_tokens": generated,
        "num_forward_passes": forwards,
        "decode_s": decode_s,
        "decode_tokens_per_s": gaps / decode_s if decode_s > 0 else 0.0,
        "itl_s_mean": decode_s / gaps if gaps else 0.0,
        "ttft_s_mean": total("ttft_s") / len(metrics_list) if metrics_list else 0.0,
        # The anchors' tau: generated tokens per target forward, prefill included (1.0 = plain).
        "tokens_per_forward": generated / forwards if forwards else 0.0,
        "num_speculative_tokens": num_speculative_tokens,
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        # vLLM's per-position rate: drafts whose i-th token was accepted, over all drafts.
        "acceptance_rate_per_pos": [c / drafts if drafts else 0.0 for c in per_pos],
        "decode_steps": decode_steps,
        "time_breakdown": None,
    }
    # Where the decode time goes; only engines that report it (specrs) get a breakdown.
    if metrics_list and all("propose_s" in m for m in metrics_list) and decode_s > 0:
        propose, forward, verify = total("propose_s"), total("forward_s"), total("verify_s")
        out["time_breakdown"] = {
            "propose_s": propose,
            "forward_s": forward,
            "verify_s": verify,
            "propose_frac": propose / decode_s,
            "forward_frac": forward / decode_s,
            "verify_frac": verify / decode_s,
            "other_frac": 1.0 - (propose + forward + verify) / decode_s,
            "propose_s_per_step": propose / decode_steps if decode_steps else 0.0,
            # The proposer's share of an average decode step (= propose_frac, said per step).
            "propose_pct_of_step": 100.0 * propose / decode_s,
        }
    return out


def expected_speedups(agg: dict, baseline_itl_s: float, verify_cost_ratios: Sequence[float] | None) -> dict:
    """The textbook and refined predictions at the measured acceptance rate, with the engine's own
    definitions (Engine.metrics()): k is the mean draft length (drafts can be shorter than
    num_speculative_tokens), the draft cost c is proposer seconds per draft over the baseline's
    seconds per token, and v(k+1) is read off the measured curve, interpolated for a fractional k.
    """
    if not agg["num_drafts"] or not agg["num_draft_tokens"]:
        return {"textbook": None, "refined": None}
    from . import expected_speedup  # specrs.expected_speedup, computed in Rust

    a = agg["acceptance_rate"]
    k = agg["num_draft_tokens"] / agg["num_drafts"]
    breakdown = agg["time_breakdown"]
    c = breakdown["propose_s"] / agg["num_drafts"] / baseline_itl_s if breakdown and baseline_itl_s > 0 else 0.0
    out = {"textbook": expected_speedup(a, k, draft_cost=c), "refined": None, "draft_cost": c,
           "mean_draft_length": k, "verify_cost_ratio": None}
    if verify_cost_ratios:
        # v(k + 1) is read off the curve [v(1), v(2), ...] in Rust, as in Engine.metrics().
        curve = list(verify_cost_ratios)
        out["refined"] = expected_speedup(a, k, draft_cost=c, verify_cost_ratio=curve)
        # With a = 0 every step yields one token, so the prediction is exactly 1 / v(k + 1).
        out["verify_cost_ratio"] = 1.0 / expected_speedup(0.0, k, verify_cost_ratio=curve)
    return out


def summarize(records: list[dict], runners: list[Runner],
              verify_cost_ratios: dict[str, Sequence[float]] | None = None) -> dict:
    """{"categories": {category: {label: aggregate}}, "overall": {label: aggregate}}.

    Each aggregate also gets `speedup_stats` (specrs.speedup.Speedup.to_dict: per repeat, decode
    tokens/s over its engine's baseline on the same prompts in the same repeat; their median, min,
    max, the tokens behind them and whether the figure is a speedup or noise), `speedup` (the
    median when it is a speedup, else None; 1.0 for a baseline), `expected_speedup` and
    `num_matching_baseline` (greedy outputs equal to the baseline's). `verify_cost_ratios` maps an
    engine name to its v(1..max_n).
    """
    verify_cost_ratios = verify_cost_ratios or {}
    baseline_of = {r.engine_name: r.label for r in runners if r.is_baseline}
    categories = list(dict.fromkeys(r["category"] for r in records))

    def table(selected: list[dict]) -> dict:
        rows = {}
        for runner in runners:
            mine = [r for r in selected if r["config"] == runner.label]
            if not mine:
                continue
            agg = aggregate([r["metrics"] for r in mine], runner.num_speculative_tokens)
            agg["engine"] = runner.engine_name
            matches = [r["matches_baseline"] for r in mine if r.get("matches_baseline") is not None]
            agg["num_matching_baseline"] = sum(matches) if matches else None
            rows[runner.label] = agg
        runner_of = {runner.label: runner for runner in runners}
        for label, agg in rows.items():
            base = rows.get(baseline_of.get(agg["engine"]))
            if base is None or not base["decode_tokens_per_s"]:
                agg["speedup"], agg["speedup_stats"] = None, None
                agg["expected_speedup"] = {"textbook": None, "refined": None}
                continue
            if runner_of[label].is_baseline:
                agg["speedup"], agg["speedup_stats"] = 1.0, None
            else:
                stats = _speedup_over_repeats(selected, label, baseline_of[agg["engine"]],
                                              runner_of[label].num_speculative_tokens)
                agg["speedup"], agg["speedup_stats"] = stats.value, stats.to_dict()
            agg["expected_speedup"] = expected_speedups(agg, base["itl_s_mean"], verify_cost_ratios.get(agg["engine"]))
        return rows

    return {
        "categories": {c: table([r for r in records if r["category"] == c]) for c in categories},
        "overall": table(records),
    }


def _speedup_over_repeats(records: list[dict], label: str, baseline: str, k: int) -> Speedup:
    """`label`'s speedup over `baseline` in each repeat of `records` (both on the same prompts)."""
    repeats = sorted({r.get("repeat", 0) for r in records})
    runs = [([r["metrics"] for r in records if r["config"] == label and r.get("repeat", 0) == i],
             [r["metrics"] for r in records if r["config"] == baseline and r.get("repeat", 0) == i]) for i in repeats]
    return Speedup.of([spec for spec, _ in runs], [base for _, base in runs], k)


# ---------------------------------------------------------------------------------------------
# Output


def fmt(value: Any, spec: str, suffix: str = "", missing: str = "-") -> str:
    """`value` formatted with `spec` plus `suffix`, or `missing` when there is none."""
    return missing if value is None else format(value, spec) + suffix


def format_speedup(agg: dict) -> str:
    """A table cell: the median speedup with its min-max and runs, or what the figure is instead."""
    stats = agg.get("speedup_stats")
    if stats is None:
        return fmt(agg.get("speedup"), ".2f", "x")
    runs = len(stats["runs"])
    if stats["verdict"] == SPEEDUP:
        spread = f"{stats['min']:.2f}-{stats['max']:.2f}, {runs} runs" if runs > 1 else "1 run, no spread"
        return f"{stats['median']:.2f}x ({spread})"
    if stats["verdict"] == NO_DRAFTS:
        return "no drafts; timing noise only"
    if stats["verdict"] == ABOVE_CEILING:
        return f"noise: {stats['median']:.2f}x > {stats['ceiling']:.2f}x ceiling"
    return "-"


def format_tables(summary: dict) -> str:
    """Markdown tables: per category and overall figures, expected speedups, time breakdown."""
    lines = ["| category | config | decode tok/s | speedup (min-max over runs) | decode tokens | mean acc. len | "
             "acc. rate | ITL mean ms |",
             "|---|---|---|---|---|---|---|---|"]
    blocks = list(summary["categories"].items()) + [("**overall**", summary["overall"])]
    for category, rows in blocks:
        for i, (label, agg) in enumerate(rows.items()):
            speculative = agg["num_speculative_tokens"] > 0
            stats = agg.get("speedup_stats") or {}
            lines.append(
                f"| {category if i == 0 else ''} | {label} | {agg['decode_tokens_per_s']:.1f} | "
                f"{format_speedup(agg)} | {stats.get('num_tokens', '-')} | "
                f"{fmt(agg['mean_acceptance_length'] if speculative else None, '.2f')} | "
                f"{fmt(agg['acceptance_rate'] if speculative else None, '.2f')} | {agg['itl_s_mean'] * 1e3:.1f} |")

    lines += ["", "Overall speedup, measured vs expected at the measured acceptance rate "
              "(textbook: verify = 1 forward; refined: verify = v(k+1) forwards):", "",
              "| config | measured | textbook | refined | mean draft len | v(k+1) | draft cost c | acc. rate per position | same output as baseline |",
              "|---|---|---|---|---|---|---|---|---|"]
    for label, agg in summary["overall"].items():
        expected = agg.get("expected_speedup") or {}
        per_pos = " ".join(f"{r:.2f}" for r in agg["acceptance_rate_per_pos"]) or "-"
        matching = agg.get("num_matching_baseline")
        lines.append(
            f"| {label} | {format_speedup(agg)} | {fmt(expected.get('textbook'), '.2f', 'x')} | "
            f"{fmt(expected.get('refined'), '.2f', 'x')} | {fmt(expected.get('mean_draft_length'), '.2f')} | "
            f"{fmt(expected.get('verify_cost_ratio'), '.2f')} | {fmt(expected.get('draft_cost'), '.4f')} | {per_pos} | "
            f"{'-' if matching is None else str(matching) + '/' + str(agg['num_requests'])} |")

    timed = {label: agg for label, agg in summary["overall"].items() if agg["time_breakdown"]}
    if timed:
        lines += ["", "Where the decode time goes (fractions of decode time, all prompts):", "",
                  "| config | decode s | propose | target forward | verify | other | propose per step | propose % of step |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, agg in timed.items():
            b = agg["time_breakdown"]
            lines.append(
                f"| {label} | {agg['decode_s']:.2f} | {b['propose_frac']:.3f} | {b['forward_frac']:.3f} | "
                f"{b['verify_frac']:.3f} | {b['other_frac']:.3f} | {b['propose_s_per_step'] * 1e6:.0f} us | "
                f"{b['propose_pct_of_step']:.2f}% |")
    return "\n".join(lines)


def machine_info() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
            "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["candle_num_threads"] = os.environ.get("CANDLE_NUM_THREADS")
    return info


def write_plot(summary: dict, path: str | os.PathLike) -> list[str]:
    """Speedup per category per configuration (the median over the repeats, its min-max as an
    error bar, and each bar marked with its runs and decode tokens; a figure that is noise is an
    empty bar marked so), and acceptance rate per draft position. Returns the notes written on the
    bars, configuration by configuration, category by category (overall last)."""
    extras.require("plot", "specrs bench --plot")
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    categories = list(summary["categories"]) + ["overall"]
    tables = [summary["categories"][c] for c in summary["categories"]] + [summary["overall"]]
    labels = [label for label, agg in summary["overall"].items() if agg.get("speedup_stats")]
    fig, (ax_speed, ax_pos) = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / max(len(labels), 1)
    notes = []
    for i, label in enumerate(labels):
        xs = [x + i * width for x in range(len(categories))]
        stats = [(t.get(label) or {}).get("speedup_stats") or {} for t in tables]
        medians = [s.get("median") or 0.0 for s in stats]
        errors = [[m - (s.get("min") or m) for m, s in zip(medians, stats)],
                  [(s.get("max") or m) - m for m, s in zip(medians, stats)]]
        bars = ax_speed.bar(xs, medians, width, yerr=errors, capsize=2, label=label)
        for bar, s in zip(bars, stats):
            if not s:
                continue
            noise = s["verdict"] != SPEEDUP
            if noise:  # not a speedup: drawn empty, so it reads as noise
                bar.set_fill(False)
                bar.set_hatch("//")
            note = f"n={len(s['runs'])}\n{s['num_tokens']} tok" + ("\nnoise" if noise else "")
            notes.append(note)
            ax_speed.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                              va="bottom", fontsize=6, xytext=(0, 2), textcoords="offset points")
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    ax_speed.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(categories))], categories, rotation=30)
    ax_speed.set_ylabel("decode tokens/s over plain decoding (median, min-max)")
    ax_speed.set_title("speedup per category (n = runs; tok = decode tokens)")
    ax_speed.legend(fontsize=8)
    for label in labels:
        rates = summary["overall"][label]["acceptance_rate_per_pos"]
        ax_pos.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    ax_pos.set_xlabel("draft position")
    ax_pos.set_ylabel("acceptance rate (accepted / drafts)")
    ax_pos.set_ylim(0, 1)
    ax_pos.set_title("acceptance per draft position, all prompts")
    ax_pos.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return notes


def make_report(engine: Engine, args: argparse.Namespace, prompts: list[dict], configs: dict[str, dict | None],
                records: list[dict], summary: dict, verify_cost_ratios: Sequence[float] | None) -> dict:
    """Everything a run produced, for the JSON file: settings, machine, per-prompt raw metrics,
    per-category and overall aggregates, the verify-cost curve."""
    return {
        "args": {key: value for key, value in vars(args).items() if key != "func"},
        "model": engine.model_path,
        "model_info": engine.info(),
        "configs": configs,
        "verify_cost_ratios": verify_cost_ratios,
        "machine": machine_info(),
        "versions": {"specrs": _specrs.__version__, "python": platform.python_version()},
        "prompts": [{key: p[key] for key in ("question_id", "category", "orig_category", "prompt_tokens", "truncated")}
                    for p in prompts],
        "records": records,
        "categories": summary["categories"],
        "overall": summary["overall"],
    }


def write_json(path: str | os.PathLike, report: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))


# ---------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default=None,
                        help="JSONL of prompts (Spec-Bench shape; first turn used; default: the set specrs ships)")
    parser.add_argument("--model", default=None, help="path of a .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--categories", default=None, help="comma list of categories (default: all)")
    parser.add_argument("--num-per-category", type=int, default=None, help="first N prompts of each category")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap each prompt in the model's chat template (default on)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed when temperature > 0")
    parser.add_argument("--config", action="append", default=[], metavar="JSON",
                        help="a speculative config, vLLM's --speculative-config format; repeatable. "
                             "The no-speculation baseline always runs too.")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help="passes over every prompt and config, each on a fresh engine; every speedup is their "
                             f"median with its min-max (default: {DEFAULT_REPEATS})")
    parser.add_argument("--max-context", type=int, default=DEFAULT_MAX_CONTEXT,
                        help="prompts are cut (user text, by characters) so prompt + max tokens fit here")
    parser.add_argument("--json", default=None, metavar="OUT", help="write everything to this JSON file")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="speedup and acceptance plot, each bar marked with its runs, tokens and "
                             f"spread (needs matplotlib: `{extras.install_command('plot')}`)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_from_args(args: argparse.Namespace) -> int:
    configs = [parse_config(text) for text in args.config]
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1 (got {args.repeats}); 3 or more give a spread")
    if args.plot:
        extras.require("plot", "specrs bench --plot")  # now, not after the whole run
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    prompts_path = args.prompts or SHIPPED_PROMPTS
    prompts = load_prompts(prompts_path, categories, args.num_per_category)
    if not prompts:
        raise ConfigError(f"no prompts selected from {prompts_path}")

    engine = Engine(args.model, device=args.device)
    prompts = tokenize_prompts(engine, prompts, args.max_tokens, args.chat, args.max_context)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed if args.temperature > 0 else None)
    print(f"{len(prompts)} prompts from {prompts_path} ({sum(p['truncated'] for p in prompts)} cut to fit "
          f"{args.max_context} tokens), {len(configs) + 1} configurations, {args.max_tokens} tokens each, "
          f"{args.repeats} repeats", file=sys.stderr)
    records: list[dict] = []
    for repeat in range(args.repeats):
        # A fresh engine per repeat (the first reuses the one that tokenized): suffix decoding's
        # cache must not hold the answers from the repeat before.
        if repeat > 0:
            engine = Engine(args.model, device=args.device)
        runners = [specrs_runner(engine, None, params)] + [specrs_runner(engine, c, params) for c in configs]
        check_unique_labels(runners)
        records += run_benchmark(prompts, runners, args.max_tokens, greedy=args.temperature == 0,
                                 progress=not args.no_progress, repeat=repeat, settle=engine.wait_for_costs)
    # v(1..k+1) for the refined prediction; measured after the run, once the configs are known good.
    max_k = max((r.num_speculative_tokens for r in runners), default=0)
    verify_cost = engine.verify_cost_ratios(max_k + 1) if max_k else None
    summary = summarize(records, runners, {"specrs": verify_cost} if verify_cost else None)

    print(format_tables(summary))
    if verify_cost:
        print("\nverify cost v(n) = t(n)/t(1): " + " ".join(f"{n}:{v:.2f}" for n, v in enumerate(verify_cost, 1)))
    if args.json:
        configs_by_label = {r.label: c for r, c in zip(runners, [None] + configs)}
        write_json(args.json, make_report(engine, args, prompts, configs_by_label, records, summary, verify_cost))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(summary, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="specrs bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run_from_args(parser.parse_args()))
