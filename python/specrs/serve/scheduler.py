"""The server's one generation thread: admits queued requests and interleaves their decoding steps.

Until continuous batching exists, requests share the engine by taking turns: each running request
(at most `max_num_seqs`) gets one decoding step per round, in arrival order, so a long request
cannot hold the others back and every stream advances. A long prompt is fed `prefill_chunk` tokens
per step, so it stalls the others' streams for one chunk at a time, not for its whole prefill.
Each step runs in Rust with the GIL released, which keeps the HTTP event loop (health, metrics,
new requests) responsive meanwhile.

Invariants: a request's session is touched only by this thread, so its output is exactly what it
would be alone (each has its own KV cache and seeded sampler); every admitted request ends with one
`Finished` or `Failed` event; a cancelled request stops before its next step and frees its caches.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..engine import Engine, TextStream
from .metrics import ServerMetrics
from .protocol import APIError, GenerationRequest, api_error_from
from .stop_strings import StopStrings


@dataclass
class Started:
    """The request left the queue and its session exists: the HTTP response may begin."""


@dataclass
class Text:
    text: str


@dataclass
class Finished:
    finish_reason: str
    num_completion_tokens: int
    metrics: dict


@dataclass
class Failed:
    error: APIError


@dataclass
class Job:
    """A request on its way through the scheduler; events reach the handler's asyncio queue."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival_s: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    stream: TextStream | None = None
    stops: StopStrings | None = None
    num_completion_tokens: int = 0
    last_token_s: float | None = None

    def send(self, event: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_num_seqs: int, prefill_chunk: int | None):
        self.engine, self.metrics, self.max_num_seqs = engine, metrics, max_num_seqs
        self.prefill_chunk = prefill_chunk
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="specrs-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def submit(self, job: Job) -> None:
        with self._wake:
            self._waiting.append(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Stops `job` before its next step (the client went away)."""
        job.cancelled = True

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._running and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    for job in list(self._running):
                        self._end(job, "abort")
                    return
                admitted = []
                while self._waiting and len(self._running) + len(admitted) < self.max_num_seqs:
                    admitted.append(self._waiting.popleft())
            for job in admitted:
                self._admit(job)
            for job in list(self._running):
                self._step(job)

    def _admit(self, job: Job) -> None:
        if job.cancelled:  # its client left while it waited
            self.metrics.request_finished(job, "abort", None)
            job.send(Finished("abort", 0, {}))
            return
        request = job.request
        try:
            job.stream = self.engine.stream(request.prompt_ids, request.params,
                                            speculative_config=request.speculative_config or False,
                                            prefill_chunk=self.prefill_chunk)
        except Exception as e:  # a bad setting only the engine can see, e.g. exit_layer out of range
            job.send(Failed(api_error_from(e)))
            return
        job.stops = StopStrings(request.stop)
        self.metrics.request_admitted(time.perf_counter() - job.arrival_s)
        self._running.append(job)
        job.send(Started())

    def _step(self, job: Job) -> None:
        if job.cancelled:
            job.stream.cancel()
            self._end(job, "abort")
            return
        try:
            out = job.stream.step()
        except Exception as e:
            job.stream.cancel()
            self._running.remove(job)
            job.send(Failed(api_error_from(e)))
            return
        if out is not None:
            text, token_ids = out
            if token_ids:
                now = time.perf_counter()
                if job.last_token_s is None:
                    self.metrics.first_token(now - job.arrival_s)
                else:
                    self.metrics.next_tokens(now - job.last_token_s)
                job.last_token_s = now
                job.num_completion_tokens += len(token_ids)
            emitted = job.stops.feed(text)
            if emitted:
                job.send(Text(emitted))
            if job.stops.stopped:
                job.stream.cancel()
                self._end(job, "stop")
                return
        if job.stream.finished:
            rest = job.stops.flush()
            if rest:
                job.send(Text(rest))
            self._end(job)

    def _end(self, job: Job, finish_reason: str | None = None) -> None:
        """Ends a running job; `finish_reason` overrides the engine's (a stop string, an abort)."""
        self._running.remove(job)
        result = job.stream.result
        finish_reason = finish_reason or result.finish_reason or "stop"
        metrics = result.metrics
        self.metrics.request_finished(job, finish_reason, metrics)
        job.send(Finished(finish_reason, job.num_completion_tokens, metrics))
