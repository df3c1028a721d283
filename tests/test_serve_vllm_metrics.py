"""`specrs serve` as a vLLM drop-in: `--max-model-len` caps the context,
`--generation-config`/`--override-generation-config` give request defaults, and /metrics carries
vLLM's own series names and labels, so vLLM's published Grafana dashboards work unchanged.

DASHBOARD_SERIES are the series that vLLM's dashboards query, with the labels they filter on:
examples/observability/prometheus_grafana/grafana.json (its "vLLM" dashboard: latency, token
throughput, scheduler state, finish reasons, queue/prefill/decode time) and
examples/observability/dashboards/grafana/vllm_speculative_decoding.json (acceptance rate and
length, per-position acceptance, token flow, inter-token latency; its template variables read
`model_name` and `engine` from `vllm:num_requests_running`). The two names specrs does not export
(NOT_EXPORTED) mean something it has no series for."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import specrs
from test_serve import running_server

openai = pytest.importorskip("openai")

# Large enough that the cost curves measured at startup are the uncapped model's (on a 512-token
# context, which needs 512 + 65 positions), so the shared disk cache of cost figures serves them.
MAX_MODEL_LEN = 1024
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SERVED = "smol"
# Requests without these fields take them (vLLM's generation-config fields).
GENERATION_DEFAULTS = {"max_new_tokens": 5, "temperature": 0}
# Series (as exposed: counters with _total, histograms by their _bucket/_sum/_count) and the labels
# the dashboards select on, besides model_name and engine.
DASHBOARD_SERIES = {
    # prometheus_grafana/grafana.json
    "vllm:e2e_request_latency_seconds_bucket": ("le",),
    "vllm:e2e_request_latency_seconds_sum": (),
    "vllm:e2e_request_latency_seconds_count": (),
    "vllm:prompt_tokens_total": (),
    "vllm:generation_tokens_total": (),
    "vllm:time_per_output_token_seconds_bucket": ("le",),
    "vllm:time_per_output_token_seconds_sum": (),
    "vllm:time_per_output_token_seconds_count": (),
    "vllm:num_requests_running": (),
    "vllm:num_requests_waiting": (),
    "vllm:time_to_first_token_seconds_bucket": ("le",),
    "vllm:time_to_first_token_seconds_sum": (),
    "vllm:time_to_first_token_seconds_count": (),
    "vllm:request_prompt_tokens_bucket": ("le",),
    "vllm:request_generation_tokens_bucket": ("le",),
    "vllm:request_success_total": ("finished_reason",),
    "vllm:request_queue_time_seconds_sum": (),
    "vllm:request_prefill_time_seconds_sum": (),
    "vllm:request_decode_time_seconds_sum": (),
    # vllm_speculative_decoding.json
    "vllm:spec_decode_num_accepted_tokens_total": (),
    "vllm:spec_decode_num_draft_tokens_total": (),
    "vllm:spec_decode_num_drafts_total": (),
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": ("position",),
    "vllm:inter_token_latency_seconds_bucket": ("le",),
    "vllm:inter_token_latency_seconds_sum": (),
    "vllm:inter_token_latency_seconds_count": (),
}
NOT_EXPORTED = {"vllm:gpu_cache_usage_perc", "vllm:request_max_num_generation_tokens_sum"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", SERVED, "--speculative-config",
             json.dumps(NGRAM), "--log-level", "warning", "--override-generation-config",
             json.dumps(GENERATION_DEFAULTS)]
    with running_server(flags, tmp_path_factory.mktemp("serve") / "server.log") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def samples(base: str) -> list:
    text = httpx.get(f"{base}/metrics").text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(rows: list, name: str, **labels) -> float:
    return sum(s.value for s in rows if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_max_model_len_caps_the_context(server, client):
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=SERVED, prompt="Hello", max_tokens=MAX_MODEL_LEN)
    assert error.value.body["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=SERVED, prompt="word " * MAX_MODEL_LEN, max_tokens=1)
    assert error.value.body["code"] == "context_length_exceeded"
    out = client.completions.create(model=SERVED, prompt="Hello", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_vllm_dashboards_find_their_series(server, client):
    before = samples(server)
    prompts = ["Repeat twice: one two three four five six.", "List the days of the week, twice."]
    for prompt in prompts:
        client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": prompt}], max_tokens=48,
                                       temperature=0)
    rows = samples(server)
    for name, extra_labels in DASHBOARD_SERIES.items():
        found = [s for s in rows if s.name == name]
        assert found, f"/metrics has no {name}, which vLLM's dashboards query"
        for s in found:
            assert s.labels.get("model_name") == SERVED and s.labels.get("engine") == "0", (name, s.labels)
            assert all(label in s.labels for label in extra_labels), (name, s.labels)
    assert not NOT_EXPORTED & {s.name for s in rows}

    def grew(name: str, **labels) -> float:
        return total(rows, name, **labels) - total(before, name, **labels)

    # The vLLM series are the specrs: ones under vLLM's names (spec decode summed over methods).
    for series in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                   "prompt_tokens", "generation_tokens"):
        assert grew(f"vllm:{series}_total") == grew(f"specrs:{series}_total"), series
    assert grew("vllm:spec_decode_num_drafts_total") > 0, "the prompts drafted"
    per_pos = {s.labels["position"]: s.value for s in rows if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert sum(per_pos.values()) == total(rows, "vllm:spec_decode_num_accepted_tokens_total")
    assert grew("vllm:request_success_total") == len(prompts)
    assert grew("vllm:request_success_total", finished_reason="length") + \
        grew("vllm:request_success_total", finished_reason="stop") == len(prompts)
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert grew(f"vllm:{histogram}_count") == grew(f"specrs:{histogram}_count") > 0, histogram
    assert grew("vllm:time_per_output_token_seconds_count") == grew("vllm:inter_token_latency_seconds_count")
    for phase in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert grew(f"vllm:request_{phase}_seconds_count") == len(prompts), phase
    assert grew("vllm:request_params_max_tokens_sum") == 48 * len(prompts)
    # The running/waiting gauges exist once, idle now.
    assert total(rows, "vllm:num_requests_running") == 0 and total(rows, "vllm:num_requests_waiting") == 0


def test_engine_max_model_len():
    engine = specrs.Engine(max_model_len=64)
    assert engine.info()["context_length"] == 64
    with pytest.raises(specrs.ContextLengthError, match="maximum context length is 64 tokens"):
        engine.generate("Hello", specrs.SamplingParams(max_tokens=64))
    assert engine.generate("Hello", specrs.SamplingParams(max_tokens=8)).metrics["num_generated_tokens"] >= 1
    with pytest.raises(specrs.ConfigError, match=r"max_model_len 100000000 is larger than the context of .* "
                                                 r"\(8192 tokens\); pass at most 8192"):
        specrs.Engine(max_model_len=100_000_000)
    for bad in (0, -1, "1k", 2.5):
        with pytest.raises(specrs.ConfigError, match=rf"max_model_len must be a positive number of tokens \(got {bad!r}\)"):
            specrs.Engine(max_model_len=bad)


def test_generation_config_fields_are_request_defaults(client):
    ask = {"model": SERVED, "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}]}
    out = client.chat.completions.create(**ask)
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (5, "length")
    greedy = client.chat.completions.create(**ask, temperature=0, max_tokens=5)
    assert out.choices[0].message.content == greedy.choices[0].message.content
    assert client.chat.completions.create(**ask, max_tokens=7).usage.completion_tokens == 7  # the request wins
    assert client.chat.completions.create(**ask, max_completion_tokens=6).usage.completion_tokens == 6


def test_generation_config_sources(tmp_path):
    from specrs.serve import generation_config

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 100, "eos_token_id": 2}))
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 100}
    assert generation_config.load("auto", str(tmp_path)) == expected  # a Hugging Face directory's own file
    assert generation_config.load(str(tmp_path), "model.gguf") == expected
    assert generation_config.load("vllm", str(tmp_path)) == {}
    assert generation_config.load("auto", os.path.join(str(tmp_path), "model.gguf")) == {}  # a GGUF has none
    assert generation_config.load("auto", str(tmp_path), '{"temperature": 0}')["temperature"] == 0
    for source, overrides, message in [
        (str(tmp_path / "nowhere"), None, "neither 'auto', 'vllm' nor a directory"),
        ("vllm", "{bad", "--override-generation-config is not JSON"),
        ("vllm", '{"temperatur": 1}', "takes an object of temperature, top_p"),
        ("vllm", '{"top_k": 2.5}', "top_k must be an integer"),
    ]:
        with pytest.raises(specrs.ConfigError, match=message):
            generation_config.load(source, None, overrides)
