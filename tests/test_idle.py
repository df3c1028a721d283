"""Speculation that does nothing says why (`IdleReason`, crates/specrs-core/src/metrics.rs): every
result's metrics count the decode steps that verified no draft, by reason, and say in words why
most of them did, through the Python API and `specrs generate`."""

from __future__ import annotations

import json
import subprocess
import sys

from specrs import SamplingParams
from specrs.cli import idle_report

REASONS = {"cost", "no_draft", "load", "max_tokens", "grammar"}


class AlwaysWrong:
    def propose(self, context_ids, max_tokens):
        return [(context_ids[-1] + 1) % 1000] * max_tokens  # never what the model says


def _chat(text):
    return [{"role": "user", "content": text}]


def test_drafts_predicted_not_to_pay_say_so_with_the_figures(engine):
    # A steep verification curve, pinned (the policy is tested, not the machine): after a few
    # rejected drafts no draft length pays at the acceptance the request measured.
    config = {"method": "custom", "num_speculative_tokens": 4, "verify_cost_ratios": [1.0, 1.4, 1.6, 2.0, 2.4]}
    r = engine.generate(_chat("Name the planets of the solar system."), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        speculative_config=config, proposer=AlwaysWrong())
    m = r.metrics
    assert set(m["idle_steps"]) == REASONS
    assert m["num_idle_steps"] == sum(m["idle_steps"].values()) > 0
    assert m["idle_steps"]["cost"] > m["num_drafts"], m  # mostly idle, for cost
    assert m["num_idle_steps"] + m["num_drafts"] == m["num_decode_steps"]
    reason = m["idle_reason"]
    assert reason.startswith("predicted speedup 0.") and "< 1 at measured acceptance 0." in reason, reason
    assert "v(2) = 1.40" in reason and "verify cost config" in reason, reason
    assert engine.metrics()["idle_steps"]["cost"] >= m["idle_steps"]["cost"]


def test_a_proposer_that_finds_nothing_says_so(engine):
    # vLLM's default prompt_lookup_min of 5 needs a 5-token repeat; this prompt and its short
    # answer have none (the README's serve example made 0 drafts this way).
    config = {"method": "ngram", "num_speculative_tokens": 6}
    r = engine.generate(_chat("Write a haiku about autumn leaves."), SamplingParams(temperature=0, max_tokens=16),
                        speculative_config=config)
    m = r.metrics
    assert m["num_drafts"] == 0 and m["idle_steps"]["no_draft"] > 0
    assert "ngram proposer found no earlier occurrence" in m["idle_reason"], m["idle_reason"]
    line = idle_report(m)
    assert line.startswith("[specrs] speculation idle in") and "no_draft" in line


def test_the_last_step_before_max_tokens_is_idle_for_lack_of_room_and_plain_decoding_reports_nothing(engine):
    # Every draft rejected: one token per step, so the step after the 11th token has no room left.
    config = {"method": "custom", "num_speculative_tokens": 4, "adaptive_draft_length": False}
    prompt = _chat("Repeat exactly: one two three four five six seven eight.")
    r = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), speculative_config=config,
                        proposer=AlwaysWrong())
    assert r.metrics["idle_steps"]["max_tokens"] == 1 and r.metrics["num_idle_steps"] == 1
    assert r.metrics["idle_reason"] == "too few tokens left before max_tokens for a draft"
    plain = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12), speculative_config=False)
    assert plain.metrics["num_idle_steps"] == 0 and plain.metrics["idle_reason"] is None
    assert idle_report(plain.metrics) is None


def test_a_grammar_that_forbids_the_draft_says_so(engine):
    # The proposer drafts digits where the grammar allows lowercase letters and spaces only: every
    # draft is cut to nothing.
    digits = engine.tokenizer.encode("123", add_special_tokens=False)[-1]

    class Digits:
        def propose(self, context_ids, max_tokens):
            return [digits] * max_tokens

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, regex="[a-z ]{12,40}")
    config = {"method": "custom", "num_speculative_tokens": 2, "adaptive_draft_length": False,
              "grammar_drafts": False}
    r = engine.generate(_chat("Describe the sky."), params, speculative_config=config, proposer=Digits())
    assert r.metrics["num_drafts"] == 0 and r.metrics["idle_steps"]["grammar"] > 0, r.metrics
    assert "grammar forbade" in r.metrics["idle_reason"]


def test_specrs_generate_reports_idle_speculation_and_no_speedup_without_drafts(model_path):
    """The CLI in a subprocess: the README's serve config on a prompt with nothing to look up."""
    out = subprocess.run([sys.executable, "-m", "specrs.cli", "generate", "--chat", "--prompt",
                          "Write a haiku about autumn leaves.", "--max-tokens", "16", "--repeats", "2",
                          "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 6})],
                         capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    idle = next(line for line in lines if line.startswith("[specrs] speculation idle"))
    assert "no_draft" in idle and "found no earlier occurrence" in idle
    speedup = next(line for line in lines if "speculative speedup" in line)
    # Zero drafts: the ratio of two timings of plain decoding is never printed as a speedup.
    assert "no drafts; timing noise only" in speedup, speedup
    assert "2 runs" in speedup
    # Startup progress goes to the log on stderr.
    assert "specrs: loading" in out.stderr and "specrs: loaded" in out.stderr
