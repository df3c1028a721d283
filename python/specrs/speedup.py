"""Speedups as specrs prints them: from interleaved repeats, with their spread and the tokens
behind them, and checked against what a run can physically reach, so timing noise is never
printed as a speedup (`specrs generate`, `specrs bench`, `specrs advise`).

The ceiling: a speculative step yields at most k + 1 tokens (k draft tokens and the target's own),
and it never costs less than a plain step (a forward over n >= 1 tokens costs at least one over
1 token, and drafting only adds). So over plain decoding a run's decode speedup is at most the
tokens it yielded per decode step, which is at most k + 1. A figure above that is noise (a
baseline run slowed by another process). A run without a single draft decoded exactly as plain
decoding does, so whatever ratio its timing shows is noise too.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

# What a figure is, for `Speedup.verdict`.
SPEEDUP = "speedup"
NO_DRAFTS = "no_drafts"
ABOVE_CEILING = "above_ceiling"
NO_RUNS = "no_runs"


def decode_totals(metrics_list: Sequence[dict]) -> tuple[int, float, int]:
    """(decode tokens, decode seconds, decode steps) of some requests: the tokens after each
    request's first (which comes from the prefill), the time from first to last token, and the
    target forwards after the prefill."""
    tokens = sum(max(m["num_generated_tokens"] - 1, 0) for m in metrics_list)
    seconds = sum(m["e2e_s"] - m["ttft_s"] for m in metrics_list if m["num_generated_tokens"] > 1)
    steps = sum(m.get("num_decode_steps", max(m["num_forward_passes"] - 1, 0)) for m in metrics_list)
    return tokens, seconds, steps


def decode_tokens_per_s(metrics_list: Sequence[dict]) -> float:
    """Decode tokens/s of some requests, a ratio of sums (0 without decode time)."""
    tokens, seconds, _ = decode_totals(metrics_list)
    return tokens / seconds if seconds > 0 else 0.0


@dataclass
class Speedup:
    """A speculative configuration's decode speedup over plain decoding, one figure per repeat."""

    # Per repeat: the configuration's decode tokens/s over plain decoding's, on the same prompts
    # in the same repeat.
    runs: list[float]
    # The configuration's decode tokens (after each request's first) over all repeats.
    num_tokens: int
    num_drafts: int
    # Decode steps over all repeats: tokens / steps is the ceiling.
    num_steps: int
    # num_speculative_tokens (0 when unknown: the ceiling is then the tokens per step alone).
    k: int = 0

    @classmethod
    def of(cls, spec_runs: Sequence[Sequence[dict]], base_runs: Sequence[Sequence[dict]], k: int = 0) -> "Speedup":
        """From the per-request metrics of each repeat: `spec_runs[r]` the configuration's,
        `base_runs[r]` plain decoding's on the same prompts."""
        runs = []
        for spec, base in zip(spec_runs, base_runs):
            base_rate = decode_tokens_per_s(base)
            if base_rate > 0:
                runs.append(decode_tokens_per_s(spec) / base_rate)
        every = [m for run in spec_runs for m in run]
        tokens, _, steps = decode_totals(every)
        return cls(runs=runs, num_tokens=tokens, num_drafts=sum(m.get("num_drafts") or 0 for m in every),
                   num_steps=steps, k=k)

    @property
    def median(self) -> float | None:
        return statistics.median(self.runs) if self.runs else None

    @property
    def ceiling(self) -> float | None:
        """The most this run can reach: its tokens per decode step (at most k + 1)."""
        if not self.num_steps:
            return None
        per_step = self.num_tokens / self.num_steps
        return min(per_step, self.k + 1) if self.k else per_step

    @property
    def verdict(self) -> str:
        if not self.runs:
            return NO_RUNS
        if self.num_drafts == 0:
            return NO_DRAFTS
        ceiling = self.ceiling
        if ceiling is not None and (self.median or 0.0) > ceiling:
            return ABOVE_CEILING
        return SPEEDUP

    @property
    def value(self) -> float | None:
        """The median over the repeats, when it is a speedup; None when it is noise."""
        return self.median if self.verdict == SPEEDUP else None

    def describe(self) -> str:
        """The figure in words: a speedup with its spread and tokens, or why it is none."""
        verdict = self.verdict
        if verdict == NO_RUNS:
            return "no speedup measured (no decode time)"
        runs = len(self.runs)
        spread = (f"min {min(self.runs):.2f}, max {max(self.runs):.2f} over {runs} runs" if runs > 1
                  else "1 run, no spread")
        if verdict == NO_DRAFTS:
            return (f"no drafts; timing noise only (it decoded as plain decoding does: {self.median:.2f}x, {spread}, "
                    f"{self.num_tokens} tokens)")
        if verdict == ABOVE_CEILING:
            return (f"not a speedup: {self.median:.2f}x ({spread}) is above the {self.ceiling:.2f}x this run can reach "
                    f"({self.num_tokens / self.num_steps:.2f} tokens per step{f' at k={self.k}' if self.k else ''}); "
                    "timing noise, likely another process slowing the runs")
        return f"{self.median:.2f}x ({spread}; {self.num_tokens} tokens)"

    def to_dict(self) -> dict:
        return {"speedup": self.value, "median": self.median, "min": min(self.runs) if self.runs else None,
                "max": max(self.runs) if self.runs else None, "runs": list(self.runs), "num_tokens": self.num_tokens,
                "num_drafts": self.num_drafts, "ceiling": self.ceiling, "verdict": self.verdict,
                "text": self.describe()}
