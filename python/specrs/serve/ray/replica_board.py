"""What the ingress of `specrs serve --ray` knows of its replicas: each one's health and metrics.

Ray Serve routes a request to some replica but cannot address one, so each replica reports to the
app's coordinator every `interval_s` (its health, its Prometheus text, its shared-suffix counters)
and the ingress reads the board: /health counts the replicas heard from within
`STALE_AFTER_S`, /metrics merges their series with a `replica` label (vLLM's names, as one
`specrs serve` shows them), beside `specrs:replicas` per state.

Invariants: a replica that stops reporting (killed) leaves the board after `STALE_AFTER_S` and
never counts as healthy again; the merged exposition names each metric family once (Prometheus
rejects repeated HELP/TYPE lines) and gives every sample its replica's id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

# A replica not heard from for this long is gone (killed, or its node lost).
STALE_AFTER_S = 5.0


@dataclass
class Report:
    replica: str
    healthy: bool
    reason: str | None  # why not healthy
    metrics_text: str
    num_running: int
    num_waiting: int
    pid: int
    node: str
    suffix_share: dict | None = None  # the replica's shared-suffix counters (suffix_share.ShareClient.stats)
    seen_s: float = 0.0


class ReplicaBoard:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.reports: dict[str, Report] = {}

    def report(self, report: Report) -> None:
        report.seen_s = self.clock()
        self.reports[report.replica] = report

    def leave(self, replica: str) -> None:
        """A replica shutting down cleanly."""
        self.reports.pop(replica, None)

    def live(self) -> list[Report]:
        """Replicas heard from within STALE_AFTER_S; older reports are dropped."""
        now = self.clock()
        for replica in [r for r, rep in self.reports.items() if now - rep.seen_s > STALE_AFTER_S]:
            del self.reports[replica]
        return sorted(self.reports.values(), key=lambda r: r.replica)

    def health(self, expected: int) -> tuple[int, dict]:
        """/health's status code and body: 200 "ok" with `expected` healthy replicas or more, 200
        "degraded" with fewer but at least one (requests are still served), 503 with none."""
        live = self.live()
        healthy = [r for r in live if r.healthy]
        status = "ok" if len(healthy) >= expected else "degraded" if healthy else "unhealthy"
        body = {"status": status, "num_replicas_healthy": len(healthy), "num_replicas_expected": expected,
                "num_requests_running": sum(r.num_running for r in healthy),
                "num_requests_waiting": sum(r.num_waiting for r in healthy),
                "replicas": [{"replica": r.replica, "healthy": r.healthy, "reason": r.reason, "pid": r.pid,
                              "node": r.node, "num_requests_running": r.num_running,
                              "num_requests_waiting": r.num_waiting, "suffix_share": r.suffix_share}
                             for r in live]}
        return (503 if not healthy else 200), body

    def render_metrics(self, expected: int) -> bytes:
        live = self.live()
        return merge_metrics([(r.replica, r.metrics_text) for r in live], {
            "healthy": sum(r.healthy for r in live), "unhealthy": sum(not r.healthy for r in live),
            "missing": max(0, expected - len(live))})


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def merge_metrics(texts: list[tuple[str, str]], replica_states: dict[str, int]) -> bytes:
    """One Prometheus exposition from each replica's (id, exposition text): every family once, its
    samples from every replica with `replica="<id>"` added."""
    families: dict[str, Metric] = {}
    for replica, text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples.extend(s._replace(labels={**s.labels, "replica": replica}) for s in family.samples)
    states = GaugeMetricFamily("specrs:replicas", "Replicas of this app by state (missing: expected but not "
                               "reporting, e.g. killed and not yet restarted).", labels=["state"])
    for state, count in replica_states.items():
        states.add_metric([state], count)
    registry = CollectorRegistry()
    registry.register(_Families([*families.values(), states]))  # type: ignore[arg-type]
    return generate_latest(registry)


__all__ = ["Report", "ReplicaBoard", "STALE_AFTER_S", "merge_metrics"]
