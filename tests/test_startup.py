"""No silent waits, and speculation that stands idle says why, against a live `specrs serve` process
started with an empty cost cache and the README's serve example as its default.

By the engine's own counters (never by a clock): no cost measurement runs in the foreground between
startup and the first request's first token, since the server starts on the prior and measures
in the background; and the startup log names each thing it waits on."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

import specrs
from test_serve import running_server

openai = pytest.importorskip("openai")

README_SPEC = {"method": "ngram", "num_speculative_tokens": 6}


def _series(metrics_text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus series, which must be there."""
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in /metrics:\n{metrics_text}")


@pytest.fixture(scope="module")
def cold_server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("startup")
    log_path = workdir / "server.log"
    env = {**os.environ, "SPECRS_CACHE_DIR": str(workdir / "empty-cache")}
    env.pop("SPECRS_LOGGING_LEVEL", None)
    with running_server(["--speculative-config", json.dumps(README_SPEC), "--log-level", "warning"], log_path,
                        env) as base:
        yield base, log_path


def test_a_cold_server_names_its_waits_and_measures_nothing_before_the_first_token(cold_server):
    base, log_path = cold_server
    startup = log_path.read_text()
    # Each wait is named before it starts: the model, the warm-up, and the cost figures it serves on
    # while the background thread measures them.
    for expected in (r"specrs: loading \S+ on cpu", r"specrs: loaded \S+ in [\d.]+ s", r"specrs: warming up",
                     r"specrs: warmed up in [\d.]+ s",
                     r"specrs: ngram k=6: verify cost prior.*measuring in the background while no request runs: "
                     r".*verification cost curve",
                     r"specrs: serving on the cost figures at hand .* while measuring in the background: "
                     r".*verification cost curve t\(1\.\.32\)",
                     r"specrs serve: `\S+` on http://"):
        assert re.search(expected, startup), f"{expected!r} not in the startup log:\n{startup}"
    before = httpx.get(f"{base}/metrics").text
    assert _series(before, "specrs:cost_measurements", thread="foreground") == 0.0

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Write a haiku about autumn leaves."}], max_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True})
    first_token_metrics, usage = None, None
    for chunk in stream:
        if first_token_metrics is None and chunk.choices and chunk.choices[0].delta.content:
            first_token_metrics = httpx.get(f"{base}/metrics").text
        if chunk.usage is not None:
            usage = chunk.usage
    assert first_token_metrics is not None, "no token arrived"
    # By the engine's counters: nothing was measured in a caller's thread up to the first token.
    assert _series(first_token_metrics, "specrs:cost_measurements", thread="foreground") == 0.0

    # The README's serve example drafts nothing on this prompt, and the response says why.
    speculative = usage.model_extra["speculative"]
    assert speculative["num_drafts"] == 0 and speculative["num_idle_steps"] > 0
    assert speculative["idle_steps"]["no_draft"] > 0
    assert "found no earlier occurrence" in speculative["idle_reason"]
    after = httpx.get(f"{base}/metrics").text
    assert _series(after, "specrs:spec_decode_idle_steps_total", method="ngram", reason="no_draft") == \
        speculative["idle_steps"]["no_draft"]
    assert _series(after, "specrs:cost_measurements", thread="foreground") == 0.0


def test_the_batch_progress_bar_covers_the_whole_call(engine, capsys, monkeypatch):
    """`generate([...])` draws its bar before anything that may take time (building the scheduler,
    reading every prompt), and counts tokens as they arrive, not only finished requests."""
    import specrs.engine

    drawn_before_scheduler = []
    real = specrs.engine._specrs.Scheduler

    def scheduler(*args, **kwargs):
        drawn_before_scheduler.append("specrs generate [" in capsys.readouterr().err)
        return real(*args, **kwargs)

    monkeypatch.setattr(specrs.engine._specrs, "Scheduler", scheduler)
    monkeypatch.setattr(specrs.engine._ProgressBar, "REDRAW_S", 0.0)  # every step, for the test
    engine.generate(["Count to five.", "Name a color."], specrs.SamplingParams(temperature=0, max_tokens=6))
    assert drawn_before_scheduler == [True]
    lines = capsys.readouterr().err.split("\r")
    assert any(" 0/2 requests, " in line and " 0 tokens" not in line for line in lines), lines
    assert "2/2 requests" in lines[-1]


def test_auto_reports_each_drafters_counts_in_the_response_and_in_metrics(cold_server):
    """"auto" picks a drafter per step; the usage and /metrics (label `drafter`) say which drafted
    what, and the counts add up to the request's."""
    base, _ = cold_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    text = "one two three four five six seven eight nine ten, " * 4
    response = client.completions.create(model=model, prompt=text, max_tokens=32, temperature=0,
                                         extra_body={"speculative": {"method": "auto"}})
    speculative = response.usage.model_extra["speculative"]
    drafters = speculative["drafters"]
    assert set(drafters) == {"suffix", "ngram"}
    assert sum(d["num_drafts"] for d in drafters.values()) == speculative["num_drafts"] > 0
    after = httpx.get(f"{base}/metrics").text
    for drafter, counts in drafters.items():
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert _series(after, f"specrs:spec_decode_drafter_{key}_total", method="auto",
                           drafter=drafter) == counts[key]
