"""The Ray Serve deployments of `specrs serve --ray`: one HTTP ingress, N engine replicas, one
coordinator.

- `EngineReplica` (N, or autoscaled): one Engine with its own continuous batcher, serving the very
  Starlette app of `specrs serve` (serve/app.py) through `asgi_call`, so routes, errors, streams,
  per-request `speculative` and usage are the single server's. It shares finished suffix responses
  (suffix_share.py), reports its health and metrics to the coordinator every second
  (replica_board.py), and fails Ray Serve's health check once its generation loop died, so Ray
  restarts it.
- `Ingress` (the HTTP entry point): checks the API key (auth.py; /health is public, /metrics too
  with metrics_public), forwards each request, body and headers as they came, to a replica chosen
  by prefix affinity (router.py); answers /health and /metrics for the whole app from the
  coordinator's board.
- `Coordinator` (1): holds the shared suffix log and the replica board; Ray restarts it if it dies
  (both start empty again: replicas keep their own caches and report again within a second).

Shutdown (`--suffix-cache`): the file is saved before anything is torn down. The driver first runs
a save round through the board (replica_board.py): each replica publishes what it finished, pulls
what its peers finished and saves, so whichever replica writes the file last, it holds every
response that ended before the round. Then Ray Serve drains each replica and calls `__del__`,
which saves again (the app's lifespan: the file first, then the generation loop) before its calls
to the coordinator, each bounded, so a replica Ray kills past `graceful_shutdown_timeout_s`, or a
driver killed mid-shutdown, loses at most what ended after the last save.

Faults: when the replica serving a request dies before the response started, the ingress retries
the request on another replica (`retries` times), since nothing reached the client; once a stream
started, its client gets OpenAI's error event (type `replica_died`) and `[DONE]`; other requests
go on. Every response names its replica in the `x-specrs-replica` header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ray import serve
from ray.exceptions import RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..auth import admits, public_paths, unauthorized
from ..errors import APIError
from . import replica_board, suffix_share
from .asgi_call import Lifespan, call_app, http_scope
from .router import affinity_keys
from .settings import ReplicaSettings

logger = logging.getLogger("specrs.serve")

REPLICA_HEADER = b"x-specrs-replica"
DEFAULT_RETRIES = 2
# How long a replica in a save round waits for its peers to publish before it saves what it has.
SAVE_ROUND_PUBLISH_WAIT_S = 10.0
# Bound on each call to the coordinator while a replica shuts down (the coordinator may be gone).
TEARDOWN_CALL_TIMEOUT_S = 5.0


@dataclass
class Forwarded:
    """One HTTP request on its way from the ingress to a replica. `affinity_keys` is read by the
    router (router.py)."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    affinity_keys: list[str] = field(default_factory=list)
    replica: str | None = None  # the replica the client asked for (x-specrs-replica)


class Coordinator:
    def __init__(self, max_shared_responses: int = suffix_share.DEFAULT_MAX_RESPONSES,
                 max_shared_tokens: int = suffix_share.DEFAULT_MAX_TOKENS):
        self.shared = suffix_share.SharedResponses(max_shared_responses, max_shared_tokens)
        self.board = replica_board.ReplicaBoard()

    def share_join(self, replica: str, has_file: bool) -> str:
        return self.shared.join(replica, has_file)

    def share_ready(self) -> bool:
        return self.shared.is_ready()

    def share_seed(self, replica: str, caches: list[tuple[str, list[bytes]]]) -> int:
        return self.shared.seed(replica, caches)

    def share_exchange(self, replica: str, published: list[tuple[str, bytes]], cursor: int):
        return self.shared.exchange(replica, published, cursor)

    def share_stats(self) -> dict:
        return self.shared.stats()

    def board_report(self, report: replica_board.Report) -> int:
        return self.board.report(report)

    def board_open_save_round(self) -> int:
        return self.board.open_save_round()

    def board_save_done(self, replica: str, save_round: int, stage: str) -> None:
        self.board.save_done(replica, save_round, stage)

    def board_save_waiting_for(self, save_round: int, stage: str) -> list[str]:
        return self.board.save_waiting_for(save_round, stage)

    def board_leave(self, replica: str) -> None:
        self.board.leave(replica)

    def board_health(self, expected: int) -> tuple[int, dict]:
        return self.board.health(expected)

    def board_metrics(self, expected: int) -> bytes:
        return self.board.render_metrics(expected)


class EngineReplica:
    async def __init__(self, settings: ReplicaSettings, coordinator):
        from .. import load_engine, served_name
        from .. import generation_config as generation
        from ..app import build_app

        self.settings, self.coordinator = settings, coordinator
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.save_round = 0  # the newest save round this replica joined
        self.engine = await asyncio.to_thread(load_engine, settings.model, settings.speculative_config,
                                              settings.device, settings.max_model_len,
                                              settings.allow_special_tokens_in_content, settings.kv_layout,
                                              settings.kv_block_size, settings.max_kv_tokens,
                                              settings.enforce_eager, settings.cuda_graph_memory_mb)
        name = settings.served_model_name or served_name(settings.model, self.engine.model_path)
        self.share = None
        role = "seed"  # without sharing, the replica loads its own file as `specrs serve` does
        if settings.share_suffix_cache:
            role = await coordinator.share_join.remote(self.replica, settings.suffix_cache is not None)
            while role == "follow" and not await coordinator.share_ready.remote():
                await asyncio.sleep(0.5)  # a peer is seeding the log from the file
            self.share = suffix_share.ShareClient(coordinator, self.replica, self.engine, settings.share_interval_s)
        self.app = build_app(
            self.engine, name, settings.max_num_seqs, settings.prefill_chunk, settings.max_request_body_bytes,
            settings.default_max_tokens, suffix_cache=settings.suffix_cache,
            suffix_cache_save_every=settings.suffix_cache_save_every,
            suffix_cache_start_empty_on_error=settings.suffix_cache_start_empty_on_error,
            max_num_batched_tokens=settings.max_num_batched_tokens, max_kv_tokens=settings.max_kv_tokens,
            draft_budget=settings.draft_budget, suffix_cache_load=role == "seed",
            extra_hooks=(self.share.on_request_finished,) if self.share is not None else (),
            generation_defaults=generation.load(settings.generation_config, self.engine.model_path,
                                                settings.override_generation_config))
        if self.share is not None:
            if role == "seed" and settings.suffix_cache is not None:
                caches = [(config, [suffix_share.pack(r) for r in responses])
                          for config, responses in self.engine.suffix_cache_responses()]
                await coordinator.share_seed.remote(self.replica, caches)
            await self.share.exchange()  # everything the peers learned so far
        self.lifespan = Lifespan(self.app)
        await self.lifespan.startup()
        self.tasks = [asyncio.create_task(self._report_loop())]
        if self.share is not None:
            self.tasks.append(asyncio.create_task(self.share.run()))
        logger.info("specrs serve: replica %s ready (pid %d)", self.replica, os.getpid())

    def _report(self) -> replica_board.Report:
        scheduler = self.app.state.scheduler
        return replica_board.Report(
            replica=self.replica, healthy=scheduler.failure is None,
            reason=None if scheduler.failure is None else f"the generation loop stopped: {scheduler.failure}",
            metrics_text=self.app.state.metrics.render().decode(), num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting, pid=os.getpid(), node=socket.gethostname(),
            suffix_share=None if self.share is None else self.share.stats())

    async def _report_loop(self) -> None:
        while True:
            try:
                save_round = await self.coordinator.board_report.remote(self._report())
                if save_round > self.save_round:
                    self.save_round = save_round
                    self.tasks.append(asyncio.create_task(self._save_round(save_round)))
            except Exception as e:
                logger.warning("specrs serve: reporting to the coordinator failed: %s", e)
            await asyncio.sleep(self.settings.report_interval_s)

    async def _save_round(self, save_round: int) -> None:
        """The driver's save at shutdown: publish what ended here, wait until every live peer has,
        pull theirs, save the suffix cache file (a replica without one only takes part)."""
        try:
            if self.share is not None:
                await self.share.exchange()
                await self.coordinator.board_save_done.remote(self.replica, save_round, "published")
                deadline = asyncio.get_running_loop().time() + SAVE_ROUND_PUBLISH_WAIT_S
                while (await self.coordinator.board_save_waiting_for.remote(save_round, "published")
                       and asyncio.get_running_loop().time() < deadline):
                    await asyncio.sleep(0.1)
                await self.share.exchange()
            store = self.app.state.suffix_cache_store
            if store is not None:
                await asyncio.to_thread(store.save)
        except Exception as e:  # the driver stops waiting for this replica after its timeout
            logger.error("specrs serve: the save round at shutdown failed on this replica: %s", e)
            return
        await self.coordinator.board_save_done.remote(self.replica, save_round, "saved")

    async def handle(self, request: Forwarded) -> AsyncIterator[dict]:
        """The ASGI messages of the app's response; the start names this replica."""
        scope = http_scope(request.method, request.path, request.query, request.headers)
        async for message in call_app(self.app, scope, request.body):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER, self.replica.encode())]}
            yield message

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose generation loop died is restarted."""
        failure = self.app.state.scheduler.failure
        if failure is not None:
            raise RuntimeError(f"the generation loop stopped: {failure}")

    async def __del__(self) -> None:
        """Ray Serve drained this replica's requests; it kills the replica if this outlasts
        graceful_shutdown_timeout_s, so the file comes first and every coordinator call is bounded."""
        for task in getattr(self, "tasks", []):
            task.cancel()
        if hasattr(self, "lifespan"):
            await self.lifespan.shutdown()  # saves the suffix cache file, then ends the generation loop
        if getattr(self, "share", None) is not None:
            try:  # what ended since the last exchange still reaches the peers that outlive this replica
                await asyncio.wait_for(self.share.exchange(), TEARDOWN_CALL_TIMEOUT_S)
            except Exception as e:
                logger.warning("specrs serve: last suffix exchange failed: %r", e)
        try:
            await asyncio.wait_for(self.coordinator.board_leave.remote(self.replica), TEARDOWN_CALL_TIMEOUT_S)
        except Exception:
            pass


def _sse_error(message: str) -> bytes:
    body = APIError(500, message, code="replica_died").body()
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class ForwardedResponse(Response):
    """A replica's response, sent on as it arrives. A replica that dies mid-body ends an event
    stream with an error event; any other body just ends (the client sees it cut short)."""

    def __init__(self, start: dict, messages, replica: str):
        self.start, self.messages, self.replica = start, messages, replica
        self.status_code = start["status"]
        self.background = None
        headers = dict(start.get("headers", []))
        self.is_event_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        await send(self.start)
        more = True
        try:
            async for message in self.messages:
                await send(message)
                more = message.get("more_body", False)
        except RayActorError as e:
            logger.warning("specrs serve: replica %s died mid-response: %s", self.replica, e)
            if self.is_event_stream:
                await send({"type": "http.response.body", "more_body": True, "body": _sse_error(
                    f"the replica serving this request ({self.replica}) died mid-stream; send the request again")})
            more = True
        finally:
            self.messages.cancel()
        if more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class Ingress:
    def __init__(self, replicas, coordinator, expected_replicas: int, max_request_body_bytes: int,
                 retries: int = DEFAULT_RETRIES, api_key: str | None = None, metrics_public: bool = False,
                 body_timeout_s: float | None = None):
        self.replicas, self.coordinator = replicas, coordinator
        self.expected_replicas = expected_replicas
        self.max_request_body_bytes = max_request_body_bytes
        self.retries = retries
        self.api_key, self.public = api_key, public_paths(metrics_public)
        self.body_timeout_s = body_timeout_s

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if not admits(request.method, path, request.headers.raw, self.api_key, self.public):
            return unauthorized()
        if path == "/health" and request.method == "GET":
            status, body = await self.coordinator.board_health.remote(self.expected_replicas)
            return JSONResponse(body, status_code=status)
        if path == "/metrics" and request.method == "GET":
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(await self.coordinator.board_metrics.remote(self.expected_replicas),
                            media_type=CONTENT_TYPE_LATEST)
        from ..app import error_response, read_body

        try:
            body = await read_body(request, self.max_request_body_bytes, self.body_timeout_s)
        except APIError as e:
            return error_response(e)
        try:
            keys = affinity_keys(path, json.loads(body)) if request.method == "POST" else []
        except (ValueError, RecursionError):
            keys = []  # the replica answers the 400
        forwarded = Forwarded(request.method, path, request.url.query.encode(), list(request.headers.raw), body, keys,
                              request.headers.get(REPLICA_HEADER.decode()))
        last_error: Exception | None = None
        for _ in range(1 + self.retries):
            messages = self.replicas.options(stream=True).handle.remote(forwarded)
            try:
                start = await messages.__anext__()
            except RayActorError as e:  # died before answering: nothing reached the client, so retry
                last_error = e
                messages.cancel()
                continue
            except StopAsyncIteration:
                return JSONResponse(APIError(500, "the replica sent no response").body(), status_code=500)
            replica = dict(start.get("headers", [])).get(REPLICA_HEADER, b"?").decode()
            return ForwardedResponse(start, messages, replica)
        return JSONResponse(APIError(503, f"no replica could serve this request ({1 + self.retries} tries; the last "
                                     f"failed with: {last_error}); retry once the app is healthy (see /health)",
                                     code="replica_died").body(), status_code=503)


__all__ = ["Coordinator", "EngineReplica", "Forwarded", "Ingress"]
