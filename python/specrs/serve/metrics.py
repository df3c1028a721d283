"""Prometheus metrics of `specrs serve`: vLLM's series under the `specrs:` prefix.

Spec-decode counters (`specrs:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}`) carry a
`method` label beside vLLM's `model_name`, since each request may pick its own method. Latencies are
seen from the client: TTFT counts from arrival (queue time included); ITL is the gap between
consecutive steps that produced tokens (a speculative step delivers several tokens at once).

Invariant: counters advance when a request ends (finished, stopped or aborted), so a cancelled
request's partial work shows up too. vLLM's own names for the series that mean the same are
exported too (vllm_metrics.py), fed from the same calls.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .vllm_metrics import VllmMetrics

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]
        self.num_running = Gauge("specrs:num_requests_running", "Requests being generated (each step batches "
                                 "all of them in one forward).", labels, registry=r).labels(model_name)
        self.num_waiting = Gauge("specrs:num_requests_waiting", "Requests queued for a generation slot (queue "
                                 "depth).", labels, registry=r).labels(model_name)
        self.prompt_tokens = Counter("specrs:prompt_tokens", "Prompt tokens of ended requests.", labels, registry=r)
        self.generation_tokens = Counter("specrs:generation_tokens", "Generated tokens of ended requests.",
                                         labels, registry=r)
        self.request_success = Counter("specrs:request_success", "Ended requests by finish reason (abort: the "
                                       "client disconnected).", labels + ["finished_reason"], registry=r)
        spec = labels + ["method"]
        self.num_drafts = Counter("specrs:spec_decode_num_drafts", "Drafts verified.", spec, registry=r)
        self.num_draft_tokens = Counter("specrs:spec_decode_num_draft_tokens", "Draft tokens verified.", spec,
                                        registry=r)
        self.num_accepted_tokens = Counter("specrs:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec,
                                           registry=r)
        self.num_accepted_per_pos = Counter("specrs:spec_decode_num_accepted_tokens_per_pos",
                                            "Drafts whose token at `position` (0-based) was accepted.",
                                            spec + ["position"], registry=r)
        self.num_tree_drafts = Counter("specrs:spec_decode_num_tree_drafts", "Drafts verified as token trees "
                                       "(the rest were chains).", spec, registry=r)
        self.num_tree_draft_tokens = Counter("specrs:spec_decode_num_tree_draft_tokens", "Tree nodes verified.",
                                             spec, registry=r)
        self.num_tree_accepted_tokens = Counter("specrs:spec_decode_num_tree_accepted_tokens", "Tokens accepted "
                                                "from trees (accepted depths, summed).", spec, registry=r)
        drafter = spec + ["drafter"]  # "auto": which drafter each count is (suffix, ngram, draft_model)
        self.drafter_num_drafts = Counter("specrs:spec_decode_drafter_num_drafts", "Drafts verified, by the drafter "
                                          "\"auto\" chose.", drafter, registry=r)
        self.drafter_num_draft_tokens = Counter("specrs:spec_decode_drafter_num_draft_tokens", "Draft tokens "
                                                "verified, by the drafter \"auto\" chose.", drafter, registry=r)
        self.drafter_num_accepted_tokens = Counter("specrs:spec_decode_drafter_num_accepted_tokens", "Draft tokens "
                                                   "accepted, by the drafter \"auto\" chose.", drafter, registry=r)
        self.ttft = Histogram("specrs:time_to_first_token_seconds", "Arrival to first token, queue time included.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("specrs:inter_token_latency_seconds", "Gap between consecutive token-producing steps.",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("specrs:e2e_request_latency_seconds", "Arrival to the end of the request.",
                             labels, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        # The continuous-batching scheduler, per step (engine/scheduler.rs): what the load budget
        # did with the drafts requests wanted.
        self.steps = Counter("specrs:scheduler_steps", "Batched forwards run by the scheduler.", labels,
                             registry=r).labels(model_name)
        self.step_seconds = Counter("specrs:scheduler_step_seconds", "Time inside the scheduler's steps (the "
                                    "batched forward, drafting, verification).", labels, registry=r).labels(model_name)
        self.overlapped_seconds = Counter("specrs:scheduler_overlapped_host_seconds", "Time the generation loop "
                                          "spent between a step's launch and its finish (sending the step "
                                          "before's outputs, adding requests) while the device ran the step; near 0 on "
                                          "the CPU, where a step's forward runs inside its launch.", labels,
                                          registry=r).labels(model_name)
        self.rows = Counter("specrs:scheduler_rows", "Rows (tokens) in the batched forwards: decode, draft and "
                            "prompt.", labels, registry=r).labels(model_name)
        self.draft_wanted = Counter("specrs:scheduler_draft_tokens_wanted", "Draft tokens requests would have "
                                    "drafted alone.", labels, registry=r).labels(model_name)
        self.draft_granted = Counter("specrs:scheduler_draft_tokens_granted", "Draft tokens the load budget "
                                     "granted.", labels, registry=r).labels(model_name)
        self.draft_verified = Counter("specrs:scheduler_draft_tokens_verified", "Draft tokens proposed and "
                                      "verified (a proposer may find fewer than granted).", labels,
                                      registry=r).labels(model_name)
        self.draft_accepted = Counter("specrs:scheduler_draft_tokens_accepted", "Draft tokens accepted.", labels,
                                      registry=r).labels(model_name)
        self.num_preemptions = Counter("specrs:num_preemptions", "Requests preempted (their KV cache freed, to be "
                                       "recomputed) for lack of KV memory.", labels, registry=r).labels(model_name)
        self.batch_size = Histogram("specrs:scheduler_batch_size", "Requests in each batched forward.", labels,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r).labels(model_name)
        self.queue_time = Histogram("specrs:request_queue_time_seconds", "Arrival to admission.",
                                    labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.vllm = VllmMetrics(r, model_name, TTFT_BUCKETS, ITL_BUCKETS, E2E_BUCKETS)
        self._idle_and_cost_series(spec)

    def _idle_and_cost_series(self, spec_labels: list[str]) -> None:
        """Why speculation stood idle (`IdleReason` in crates/specrs-core/src/metrics.rs), and the
        engine's cost measurements (engine/cost_worker.rs): a foreground one would have stalled
        the caller, so a server's stays at 0."""
        r, labels = self.registry, ["model_name"]
        self.idle_steps = Counter("specrs:spec_decode_idle_steps", "Decode steps of speculating requests that "
                                  "verified no draft, by reason: cost (drafts predicted not to pay at the measured "
                                  "acceptance), no_draft (the proposer found none), load (the load budget granted "
                                  "none), max_tokens (too few tokens left), grammar (the grammar forbade it).",
                                  spec_labels + ["reason"], registry=r)
        self.cost_measurements = Gauge("specrs:cost_measurements", "Cost figures the engine measured since it "
                                       "started, by thread: foreground (a caller waited) or background (while no "
                                       "request ran).", labels + ["thread"], registry=r)
        self.cost_measurements_pending = Gauge("specrs:cost_measurements_pending", "Cost figures queued for the "
                                               "background thread.", labels, registry=r).labels(self.model_name)

    def report_costs(self, cost_status: Callable[[], dict]) -> None:
        """The cost gauges read the engine's `cost_status()` whenever /metrics is scraped."""
        for thread in ("foreground", "background"):
            key = f"num_{thread}_measurements"
            self.cost_measurements.labels(self.model_name, thread).set_function(lambda key=key: cost_status()[key])
        self.cost_measurements_pending.set_function(lambda: len(cost_status()["pending"]))

    def report_step_graphs(self, step_graph_status: Callable[[], dict | None]) -> None:
        """The captured steps' series (CUDA graphs: `Engine.step_graph_status()`), read whenever
        /metrics is scraped; none for a model that captures none (the CPU decoder)."""
        self.registry.register(_StepGraphCollector(self.model_name, step_graph_status))

    def report_queue(self, num_running: Callable[[], int], num_waiting: Callable[[], int]) -> None:
        """The gauges read the scheduler's queue whenever /metrics is scraped."""
        self.num_running.set_function(num_running)
        self.num_waiting.set_function(num_waiting)
        self.vllm.report_queue(num_running, num_waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def scheduler_step(self, report: dict, seconds: float) -> None:
        """One step's report from the core scheduler, and the step's time."""
        self.step_seconds.inc(seconds)
        self.overlapped_seconds.inc(report["overlapped_host_s"])
        if report["num_sequences"]:
            self.steps.inc()
            self.batch_size.observe(report["num_sequences"])
        self.rows.inc(report["num_rows"])
        self.draft_wanted.inc(report["num_draft_tokens_wanted"])
        self.draft_granted.inc(report["num_draft_tokens_granted"])
        self.draft_verified.inc(report["num_draft_tokens"])
        self.draft_accepted.inc(report["num_accepted_tokens"])
        self.num_preemptions.inc(report["num_preempted"])
        self.vllm.preempted(report["num_preempted"])

    def request_admitted(self, queue_s: float) -> None:
        self.queue_time.observe(queue_s)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.vllm.first_token(ttft_s)

    def next_tokens(self, gap_s: float) -> None:
        self.itl.observe(gap_s)
        self.vllm.next_tokens(gap_s)

    def request_finished(self, job, finish_reason: str, metrics: dict | None) -> None:
        """`job` is a scheduler Job; `metrics` the engine's for it (None: it never started). Each
        sample of an `n` > 1 request counts as a request; its prompt counts once (sample 0)."""
        self.vllm.request_finished(job, finish_reason, metrics)
        name = self.model_name
        self.e2e.observe(time.perf_counter() - job.arrival_s)
        self.request_success.labels(name, finish_reason).inc()
        if job.index == 0:
            self.prompt_tokens.labels(name).inc(len(job.request.prompt_ids))
        self.generation_tokens.labels(name).inc(job.num_completion_tokens)
        if not metrics or not metrics.get("spec_method"):
            return
        method = metrics["spec_method"]
        self.num_drafts.labels(name, method).inc(metrics["num_drafts"])
        self.num_draft_tokens.labels(name, method).inc(metrics["num_draft_tokens"])
        self.num_accepted_tokens.labels(name, method).inc(metrics["num_accepted_tokens"])
        self.num_tree_drafts.labels(name, method).inc(metrics["num_tree_drafts"])
        self.num_tree_draft_tokens.labels(name, method).inc(metrics["num_tree_draft_tokens"])
        self.num_tree_accepted_tokens.labels(name, method).inc(metrics["num_tree_accepted_tokens"])
        for position, count in enumerate(metrics["num_accepted_tokens_per_pos"]):
            self.num_accepted_per_pos.labels(name, method, str(position)).inc(count)
        for reason, count in metrics.get("idle_steps", {}).items():
            if count:
                self.idle_steps.labels(name, method, reason).inc(count)
        for drafter, counts in metrics.get("drafters", {}).items():
            self.drafter_num_drafts.labels(name, method, drafter).inc(counts["num_drafts"])
            self.drafter_num_draft_tokens.labels(name, method, drafter).inc(counts["num_draft_tokens"])
            self.drafter_num_accepted_tokens.labels(name, method, drafter).inc(counts["num_accepted_tokens"])


class _StepGraphCollector:
    """`specrs:cuda_graph_*`: steps replayed, captured and run eagerly (by reason), and the graphs'
    memory against its budget, from the engine's counts at scrape time."""

    def __init__(self, model_name: str, status: Callable[[], dict | None]):
        self.model_name, self.status = model_name, status

    def collect(self):
        status = self.status()
        if status is None:
            return
        name = [self.model_name]
        replays = CounterMetricFamily("specrs:cuda_graph_replays", "Steps replayed from a captured CUDA graph.",
                                      labels=["model_name"])
        replays.add_metric(name, status["num_replays"])
        captures = CounterMetricFamily("specrs:cuda_graph_captures", "Steps captured as a CUDA graph (one per "
                                       "padded shape).", labels=["model_name"])
        captures.add_metric(name, status["num_captures"])
        eager = CounterMetricFamily("specrs:cuda_graph_eager_steps", "Steps of an engine capturing graphs that ran "
                                    "eagerly, by reason: warmup (a shape's first step), shape (past the largest "
                                    "captured shape: prompt chunks, batches over 64), budget, busy, room, "
                                    "capture_failed.", labels=["model_name", "reason"])
        for reason, n in status["num_eager"].items():
            eager.add_metric(name + [reason], n)
        graphs = GaugeMetricFamily("specrs:cuda_graphs", "Captured CUDA graphs.", labels=["model_name"])
        graphs.add_metric(name, status["num_graphs"])
        used = GaugeMetricFamily("specrs:cuda_graph_memory_bytes", "The captured graphs' activation estimates, "
                                 "summed.", labels=["model_name"])
        used.add_metric(name, status["used_bytes"])
        budget = GaugeMetricFamily("specrs:cuda_graph_memory_budget_bytes", "The most the captured graphs may hold "
                                   "(--cuda-graph-memory-mb).", labels=["model_name"])
        budget.add_metric(name, status["budget_bytes"])
        yield from (replays, captures, eager, graphs, used, budget)

