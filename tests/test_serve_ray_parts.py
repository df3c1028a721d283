"""The parts of `specrs serve --ray` that need no Ray cluster: the shared suffix log's bounds and
seeding, the affinity keys, the merged metrics exposition, and the in-process ASGI call
(tests/test_serve_ray.py runs the whole app)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("prometheus_client")

from specrs import SpeculativeConfig  # noqa: E402
from specrs.serve.ray.asgi_call import Lifespan, call_app, http_scope  # noqa: E402
from specrs.serve.ray.replica_board import Report, ReplicaBoard, merge_metrics  # noqa: E402
from specrs.serve.ray.suffix_share import (  # noqa: E402
    SEED_LEASE_S,
    SharedResponses,
    ShareClient,
    pack,
    unpack,
)


def test_tokens_round_trip_as_uint32():
    assert unpack(pack([0, 1, 2**32 - 1, 49151])) == [0, 1, 2**32 - 1, 49151]
    assert len(pack([1, 2, 3])) == 12


def test_a_replica_publishes_the_responses_of_every_config_that_keeps_a_suffix_cache():
    """"suffix" and "auto" (its suffix lookup keeps its own cache) are shared, under their config's
    JSON; other methods and no speculation are not (Rust says which configs keep one)."""
    client = ShareClient(coordinator=None, replica="a", engine=None, interval_s=1.0)
    configs = [SpeculativeConfig.from_json(text) for text in
               ('{"method": "suffix"}', '{"method": "auto"}', '{"method": "ngram", "num_speculative_tokens": 2}')]
    for config in [*configs, None]:
        job = type("Job", (), {"request": type("Request", (), {"speculative_config": config})(),
                               "response_ids": [5, 6]})()
        client.on_request_finished(job, "stop", None)
    assert [config for config, _ in client._outbox] == [config.to_json() for config in configs[:2]]
    assert all(unpack(tokens) == [5, 6] for _, tokens in client._outbox)


def test_the_shared_log_returns_others_responses_once_in_order():
    log = SharedResponses(max_responses=10, max_tokens=100)
    pulled, cursor, missed = log.exchange("a", [("c", pack([1, 2])), ("c", pack([3]))], 0)
    assert pulled == [] and cursor == 2 and missed == 0  # its own are never sent back
    pulled, cursor_b, _ = log.exchange("b", [("d", pack([4]))], 0)
    assert [unpack(t) for _, t in pulled] == [[1, 2], [3]] and cursor_b == 3
    pulled, cursor, _ = log.exchange("a", [], cursor)
    assert pulled == [("d", pack([4]))] and cursor == 3
    assert log.exchange("b", [], cursor_b)[0] == []  # nothing new


def test_the_shared_log_is_bounded_and_reports_what_a_late_replica_missed():
    log = SharedResponses(max_responses=3, max_tokens=5)
    for i in range(4):
        log.exchange("a", [("c", pack([i]))], 0)
    assert log.stats()["num_responses"] == 3 and log.stats()["num_evicted"] == 1
    pulled, cursor, missed = log.exchange("b", [], 0)
    assert [unpack(t) for _, t in pulled] == [[1], [2], [3]] and missed == 1 and cursor == 4
    log.exchange("a", [("c", pack([7, 8, 9]))], 0)  # 3 + 1 + 1 + 1 tokens > 5: the oldest go
    assert log.stats()["num_tokens"] <= 5
    assert log.exchange("a", [("c", pack(list(range(6))))], 0)[1] == 5  # longer than the whole log: not kept
    assert log.stats()["num_tokens"] <= 5


def test_one_replica_seeds_the_log_from_the_file_and_the_others_follow():
    now = [0.0]
    log = SharedResponses(clock=lambda: now[0])
    assert log.join("a", has_file=False) == "follow" and log.is_ready()  # no file: nothing to seed
    assert log.join("a", has_file=True) == "seed"
    assert log.join("b", has_file=True) == "follow" and not log.is_ready()
    now[0] += SEED_LEASE_S + 1  # the seeder died before seeding: the next one seeds
    assert log.is_ready() and log.join("c", has_file=True) == "seed"
    assert log.seed("c", [("cfg", [pack([1, 2]), pack([3])])]) == 2
    assert log.is_ready() and log.join("d", has_file=True) == "follow"
    assert log.seed("a", [("cfg", [pack([9])])]) == 0  # seeded once
    assert [unpack(t) for _, t in log.exchange("d", [], 0)[0]] == [[1, 2], [3]]
    assert log.exchange("c", [], 0)[0] == []  # the seeder has them


def test_affinity_keys_follow_conversations_not_shared_system_prompts():
    pytest.importorskip("ray.serve")
    from specrs.serve.ray.router import BLOCK_CHARS, affinity_keys

    system = {"role": "system", "content": "You are terse."}
    turn1 = [system, {"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    keys1, keys2 = affinity_keys("/v1/chat/completions", {"messages": turn1}), \
        affinity_keys("/v1/chat/completions", {"messages": turn2})
    assert len(keys1) == 1 and keys2[0] == keys1[0] and len(keys2) == 3
    assert affinity_keys("/v1/chat/completions", {"messages": [system]}) == []
    other = affinity_keys("/v1/chat/completions", {"messages": [system, {"role": "user", "content": "yo"}]})
    assert other[0] != keys1[0]
    prompt = "x" * (2 * BLOCK_CHARS + 10)
    keys = affinity_keys("/v1/completions", {"prompt": prompt})
    assert len(keys) == 3 and affinity_keys("/v1/completions", {"prompt": prompt[:BLOCK_CHARS + 1]})[0] == keys[0]
    assert affinity_keys("/v1/completions", {"prompt": ["a", "b"]}) == []
    assert affinity_keys("/v1/models", {"messages": turn1}) == [] and affinity_keys("/v1/completions", []) == []


def test_a_request_naming_a_replica_waits_for_it_alone(monkeypatch):
    """A named replica is the only rank (never the load spread, which a slow queue-length probe on a
    loaded machine would fall through to); a name the router has not seen yet is waited for, up to
    PIN_WAIT_S; a replica that left is not waited for."""
    pytest.importorskip("ray.serve")
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve._private.request_router.common import RequestRoutingContext

    from specrs.serve.ray import router as router_module

    def replica(name):
        return SimpleNamespace(replica_id=ReplicaID(name, DeploymentID("engine", "app")), max_ongoing_requests=4)

    def ask(name, candidates):
        request = SimpleNamespace(args=[SimpleNamespace(affinity_keys=[], replica=name)],
                                  routing_context=RequestRoutingContext())
        ranks = asyncio.run(router.choose_replicas(candidates, request))
        assert request.routing_context.should_backoff  # Ray Serve sleeps between rounds
        return [[r.replica_id.unique_id for r in rank] for rank in ranks]

    router = router_module.PrefixAffinityRouter.__new__(router_module.PrefixAffinityRouter)
    router.initialize_state()
    router._replica_queue_len_cache = {}
    a, b, c = replica("a"), replica("b"), replica("c")
    assert ask("b", [a, b]) == [["b"]]
    now = [100.0]
    monkeypatch.setattr(router_module.time, "monotonic", lambda: now[0])
    assert ask("c", [a, b]) == []  # not seen yet: asked again after a backoff
    now[0] += router_module.PIN_WAIT_S - 0.1
    assert ask("c", [a, b, c]) == [["c"]]  # it arrived in time
    assert sorted(ask("b", [a, c])[0]) == ["a", "c"]  # b left: spread at once
    assert ask("d", [a, c]) == []
    now[0] += router_module.PIN_WAIT_S
    assert sorted(ask("d", [a, c])[0]) == ["a", "c"]  # never came: spread


def _report(replica: str, healthy: bool = True, text: str = "") -> Report:
    return Report(replica, healthy, None if healthy else "stopped", text, 1, 2, 100, "node")


def test_the_board_forgets_silent_replicas_and_grades_health():
    now = [0.0]
    board = ReplicaBoard(clock=lambda: now[0])
    assert board.health(2)[0] == 503
    board.report(_report("a"))
    board.report(_report("b"))
    status, body = board.health(2)
    assert status == 200 and body["status"] == "ok" and body["num_requests_waiting"] == 4
    now[0] += 3
    board.report(_report("a"))
    board.report(_report("b", healthy=False))
    assert board.health(2)[1]["status"] == "degraded"
    now[0] += 10  # neither reported since: both gone
    status, body = board.health(2)
    assert status == 503 and body["status"] == "unhealthy" and body["replicas"] == []


def test_merged_metrics_name_each_family_once_with_replica_labels():
    from specrs.serve.metrics import ServerMetrics

    texts = []
    for replica, tokens in (("a", 5), ("b", 7)):
        metrics = ServerMetrics("m")
        metrics.prompt_tokens.labels("m").inc(tokens)
        texts.append((replica, metrics.render().decode()))
    out = merge_metrics(texts, {"healthy": 2, "missing": 0}).decode()
    assert out.count("# TYPE specrs:prompt_tokens_total counter") == 1
    assert 'specrs:prompt_tokens_total{model_name="m",replica="a"} 5.0' in out
    assert 'specrs:prompt_tokens_total{model_name="m",replica="b"} 7.0' in out
    assert 'specrs:replicas{state="healthy"} 2.0' in out


def test_a_save_round_waits_for_every_live_replica_to_publish_then_save():
    now = [0.0]
    board = ReplicaBoard(clock=lambda: now[0])
    assert board.report(_report("a")) == 0 and board.report(_report("b")) == 0  # no round yet
    first = board.open_save_round()
    assert board.report(_report("a")) == first  # each replica learns of it from its next report
    assert board.save_waiting_for(first, "published") == ["a", "b"]
    board.save_done("a", first, "published")
    assert board.save_waiting_for(first, "published") == ["b"]
    board.save_done("b", first, "saved")  # saved implies published
    assert board.save_waiting_for(first, "published") == []
    assert board.save_waiting_for(first, "saved") == ["a"]
    board.save_done("a", first, "saved")
    assert board.save_waiting_for(first, "saved") == []
    second = board.open_save_round()
    assert second > first and board.save_waiting_for(second, "saved") == ["a", "b"]
    board.save_done("a", first, "saved")  # a late report of an older round does not count
    assert board.save_waiting_for(second, "saved") == ["a", "b"]
    now[0] += 3
    board.report(_report("a"))
    now[0] += 3  # b fell silent (killed): no round waits for it
    assert board.save_waiting_for(second, "saved") == ["a"]


def test_an_asgi_call_streams_and_tells_the_app_its_client_left():
    events = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                events.append(message["type"])
                kind = message["type"].split(".")[1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"a", b"b")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        events.append((await receive())["type"])  # waits until the caller stops reading

    async def main():
        lifespan = Lifespan(app)
        await lifespan.startup()
        messages = call_app(app, http_scope("POST", "/x", b"", []), b"hello")
        start = await messages.__anext__()
        body = await messages.__anext__()
        await messages.aclose()
        await lifespan.shutdown()
        return start, body

    start, body = asyncio.run(main())
    assert start["status"] == 200 and body["body"] == b"hello"
    assert events == ["lifespan.startup", "http.disconnect", "lifespan.shutdown"]
