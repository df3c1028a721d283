"""vLLM's own metric names on `specrs serve`'s /metrics, beside the `specrs:` series, so a Grafana
dashboard built for vLLM (examples/observability/prometheus_grafana/grafana.json and the
speculative-decoding dashboard in vLLM's repository) works unchanged.

Every series carries vLLM's labels: `model_name` (the served name) and `engine` ("0": one engine
per server, as a single-engine vLLM labels it; the dashboards filter on both). Exported where the
meaning is the same as vLLM's:
- `vllm:num_requests_running`, `vllm:num_requests_waiting` (gauges read at scrape time);
- `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}`,
  `vllm:num_preemptions_total`;
- `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`,
  `..._num_accepted_tokens_per_pos_total{position}`: summed over methods (vLLM has no `method`
  label; `specrs:spec_decode_*` keeps it);
- histograms `vllm:time_to_first_token_seconds` (from arrival), `vllm:inter_token_latency_seconds`
  and its older name `vllm:time_per_output_token_seconds` (the same gaps, as vLLM observes both),
  `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds` (arrival to admission),
  `vllm:request_prefill_time_seconds` (admission to first token), `vllm:request_decode_time_seconds`
  (first token to end), `vllm:request_inference_time_seconds` (admission to end),
  `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`, `vllm:request_params_max_tokens`.
Not exported, because specrs has no series that means the same: `vllm:gpu_cache_usage_perc` and
`vllm:kv_cache_usage_perc` (no fixed KV pool unless `--max-kv-tokens`), prefix-cache hits,
`vllm:request_max_num_generation_tokens`.

Invariant: counters advance when a request ends (as the `specrs:` ones do), so one request's
numbers appear together; vLLM advances its spec-decode counters per step, which sums the same.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# The engine index every series is labelled with: one engine per `specrs serve`.
ENGINE_INDEX = "0"
# Request token counts: 1, 2, 5, 10, ... up to a million (vLLM's 1-2-5 buckets).
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5) if m * 10 ** e <= 1_000_000)


class VllmMetrics:
    """The vLLM-named series, registered in `registry`; `ServerMetrics` feeds them."""

    def __init__(self, registry: CollectorRegistry, model_name: str, ttft_buckets, itl_buckets, e2e_buckets):
        r, labels, key = registry, ["model_name", "engine"], (model_name, ENGINE_INDEX)
        self.key = key

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*key)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*key)

        self.num_running = Gauge("vllm:num_requests_running", "Requests being generated.", labels,
                                 registry=r).labels(*key)
        self.num_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a generation slot.", labels,
                                 registry=r).labels(*key)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of ended requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of ended requests.")
        self.num_preemptions = counter("vllm:num_preemptions", "Requests preempted for lack of KV memory.")
        self.request_success = Counter("vllm:request_success", "Ended requests by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Drafts verified.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.num_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                            "Drafts whose token at `position` (0-based) was accepted.",
                                            labels + ["position"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", ttft_buckets)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Gap between token-producing steps.", itl_buckets)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Gap between token-producing steps "
                              "(vLLM's older name of vllm:inter_token_latency_seconds).", itl_buckets)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to the end of the request.", e2e_buckets)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to admission.", e2e_buckets)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "Admission to first token.", e2e_buckets)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to the end.", e2e_buckets)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "Admission to the end.", e2e_buckets)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                                   TOKEN_BUCKETS)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens of each request.",
                                            TOKEN_BUCKETS)

    def report_queue(self, num_running, num_waiting) -> None:
        self.num_running.set_function(num_running)
        self.num_waiting.set_function(num_waiting)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def next_tokens(self, gap_s: float) -> None:
        self.itl.observe(gap_s)
        self.tpot.observe(gap_s)

    def preempted(self, count: int) -> None:
        self.num_preemptions.inc(count)

    def request_finished(self, job, finish_reason: str, metrics: dict | None) -> None:
        """As `ServerMetrics.request_finished`: each sample of an `n` > 1 request is a request, its
        prompt counted once (sample 0)."""
        now = time.perf_counter()
        self.e2e.observe(now - job.arrival_s)
        self.request_success.labels(*self.key, finish_reason).inc()
        num_prompt = len(job.request.prompt_ids)
        if job.index == 0:
            self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(job.num_completion_tokens)
        self.request_prompt_tokens.observe(num_prompt)
        self.request_generation_tokens.observe(job.num_completion_tokens)
        self.request_max_tokens.observe(job.request.params.max_tokens)
        if job.admitted_s is not None:
            self.queue_time.observe(job.admitted_s - job.arrival_s)
            self.inference_time.observe(now - job.admitted_s)
            if job.first_token_s is not None:
                self.prefill_time.observe(job.first_token_s - job.admitted_s)
                self.decode_time.observe(now - job.first_token_s)
        if not metrics or not metrics.get("spec_method"):
            return
        self.num_drafts.inc(metrics["num_drafts"])
        self.num_draft_tokens.inc(metrics["num_draft_tokens"])
        self.num_accepted_tokens.inc(metrics["num_accepted_tokens"])
        for position, count in enumerate(metrics["num_accepted_tokens_per_pos"]):
            self.num_accepted_per_pos.labels(*self.key, str(position)).inc(count)
