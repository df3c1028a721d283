"""What the ingress of `specrs serve --ray` knows of its replicas: each one's health and metrics.

Ray Serve routes a request to some replica but cannot address one, so each replica reports to the
app's coordinator every `interval_s` (its health, its Prometheus text, its shared-suffix counters)
and the ingress reads the board: /health counts the replicas heard from within
`STALE_AFTER_S`, /metrics merges their series with a `replica` label (vLLM's names, as one
`specrs serve` shows them), beside `specrs:replicas` per state.

The board also runs the save rounds of `--suffix-cache` at shutdown (ray/__init__.py's `run`):
the driver opens a round, every replica learns of it from its next report's answer, publishes what
it finished to its peers, waits until every live replica has, pulls theirs and saves; the driver
waits for every live replica's save before it tears the app down.

Invariants: a replica that stops reporting (killed) leaves the board after `STALE_AFTER_S` and
never counts as healthy again, nor is waited for by a save round; the merged exposition names each
metric family once (Prometheus rejects repeated HELP/TYPE lines) and gives every sample its
replica's id; a round's stages only advance (a replica's saved round implies its published one).
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


# The stages of a save round, in order.
SAVE_STAGES = ("published", "saved")


class ReplicaBoard:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.reports: dict[str, Report] = {}
        self.save_round = 0  # the newest round the driver opened (0: none)
        # Per stage, per replica: the newest round it completed that stage of.
        self.save_progress: dict[str, dict[str, int]] = {stage: {} for stage in SAVE_STAGES}

    def report(self, report: Report) -> int:
        """Records `report`; returns the newest save round, which the replica joins if it is new to it."""
        report.seen_s = self.clock()
        self.reports[report.replica] = report
        return self.save_round

    def open_save_round(self) -> int:
        self.save_round += 1
        return self.save_round

    def save_done(self, replica: str, save_round: int, stage: str) -> None:
        """`replica` completed `stage` of `save_round` (and so every earlier stage of it)."""
        for s in SAVE_STAGES[:SAVE_STAGES.index(stage) + 1]:
            done = self.save_progress[s]
            done[replica] = max(done.get(replica, 0), save_round)

    def save_waiting_for(self, save_round: int, stage: str) -> list[str]:
        """The live replicas that have not completed `stage` of `save_round` yet."""
        done = self.save_progress[stage]
        return [r.replica for r in self.live() if done.get(r.replica, 0) < save_round]

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


__all__ = ["Report", "ReplicaBoard", "SAVE_STAGES", "STALE_AFTER_S", "merge_metrics"]
