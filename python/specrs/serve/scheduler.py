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
Nothing one request does stops the others: an exception (or a Rust panic, which the bindings turn
into a SpecrsError) in one request's admission or step ends that request alone with a 500 and
`finished_reason="error"`, and the loop goes on. Should the loop itself ever die, `failure` says
why (/health answers 503), every request in it fails, and later ones are refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..engine import Engine, TextStream
from .metrics import ServerMetrics
from .protocol import APIError, GenerationRequest, api_error_from
from .stop_strings import StopStrings

logger = logging.getLogger("specrs.serve")


@dataclass
class Started:
    """The request left the queue and its session exists: the HTTP response may begin."""


@dataclass
class Text:
    text: str
    num_completion_tokens: int = 0  # tokens generated so far (stream_options.continuous_usage_stats)


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
    ended: bool = False  # its Finished or Failed event was sent

    def send(self, event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (server shutdown): nobody is listening
            pass


def _is_fatal(error: BaseException) -> bool:
    """Exceptions a per-request handler must not swallow. Everything else, including PyO3's
    PanicException (a BaseException), ends one request only."""
    return isinstance(error, (KeyboardInterrupt, SystemExit))


class Scheduler:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_num_seqs: int, prefill_chunk: int | None,
                 on_request_finished=None):
        self.engine, self.metrics, self.max_num_seqs = engine, metrics, max_num_seqs
        self.prefill_chunk = prefill_chunk
        # Called (job, finish_reason, metrics) after each request that ran ends (the suffix cache
        # store saves every N); whatever it raises is logged, never the request's or the loop's end.
        self.on_request_finished = on_request_finished
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._admitting: list[Job] = []  # taken off the queue this round, not yet running
        self._wake = threading.Condition()
        self._stopping = False
        # Why the loop died ("ExceptionType: message"); None while it runs.
        self.failure: str | None = None
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
            if self.failure is None:
                self._waiting.append(job)
                self._wake.notify()
                return
        job.ended = True
        job.send(Failed(APIError(503, f"the server cannot generate: its generation loop stopped ({self.failure}); "
                                 "restart it", code="service_unavailable")))

    def cancel(self, job: Job) -> None:
        """Stops `job` before its next step (the client went away)."""
        job.cancelled = True

    def _loop(self) -> None:
        try:
            self._rounds()
        except BaseException as e:  # a bug outside any one request: say so on /health, fail everyone
            with self._wake:
                self.failure = f"{type(e).__name__}: {e}"
                jobs = list(self._running) + self._admitting + list(self._waiting)
                self._running.clear()
                self._waiting.clear()
            logger.exception("specrs serve: the generation loop stopped; /health now answers 503")
            for job in jobs:
                self._fail(job, e, status=503)

    def _rounds(self) -> None:
        while True:
            admitted = self._next_admissions()
            if admitted is None:
                for job in list(self._running):
                    self._guarded(job, lambda j: self._end(j, "abort"))
                return
            for job in admitted:
                self._guarded(job, self._admit)
            for job in list(self._running):
                self._guarded(job, self._step)

    def _next_admissions(self) -> list[Job] | None:
        """Waits for work; the jobs to admit this round (None: the server is stopping)."""
        with self._wake:
            while not self._waiting and not self._running and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            admitted = []
            while self._waiting and len(self._running) + len(admitted) < self.max_num_seqs:
                admitted.append(self._waiting.popleft())
            self._admitting = admitted
            return admitted

    def _guarded(self, job: Job, action) -> None:
        """Runs `action(job)`; whatever it raises ends `job` alone."""
        try:
            action(job)
        except BaseException as e:
            if _is_fatal(e):
                raise
            self._fail(job, e)

    def _fail(self, job: Job, error: BaseException, status: int | None = None) -> None:
        """Ends `job` after `error`: its stream is stopped (freeing its caches), it is counted with
        finished_reason "error", and its client gets the error (a 500 for internal faults)."""
        if job in self._running:
            self._running.remove(job)
        metrics = None
        if job.stream is not None:
            try:
                job.stream.cancel()
                metrics = job.stream.result.metrics
            except BaseException as e:  # the stream is beyond use; the request still ends
                if _is_fatal(e):
                    raise
        if job.ended:
            return
        job.ended = True
        api_error = api_error_from(error) if status is None else APIError(
            status, f"the generation loop stopped: {type(error).__name__}: {error}", code="service_unavailable")
        if api_error.status >= 500:
            self.metrics.request_finished(job, "error", metrics)
        job.send(Failed(api_error))

    def _admit(self, job: Job) -> None:
        if job.cancelled:  # its client left while it waited
            self.metrics.request_finished(job, "abort", None)
            job.ended = True
            job.send(Finished("abort", 0, {}))
            return
        request = job.request
        # An exception here is a bad setting only the engine can see (a 400, e.g. exit_layer out of
        # range) or an internal fault (a 500); `_guarded` sends it.
        job.stream = self.engine.stream(request.prompt_ids, request.params,
                                        speculative_config=request.speculative_config or False,
                                        prefill_chunk=self.prefill_chunk)
        job.stops = StopStrings(request.stop)
        self.metrics.request_admitted(time.perf_counter() - job.arrival_s)
        self._running.append(job)
        job.send(Started())

    def _step(self, job: Job) -> None:
        if job.cancelled:
            job.stream.cancel()
            self._end(job, "abort")
            return
        out = job.stream.step()  # a failure ends this job alone (`_guarded`)
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
                job.send(Text(emitted, job.num_completion_tokens))
            if job.stops.stopped:
                job.stream.cancel()
                self._end(job, "stop")
                return
        if job.stream.finished:
            rest = job.stops.flush()
            if rest:
                job.send(Text(rest, job.num_completion_tokens))
            self._end(job)

    def _end(self, job: Job, finish_reason: str | None = None) -> None:
        """Ends a running job; `finish_reason` overrides the engine's (a stop string, an abort)."""
        result = job.stream.result
        finish_reason = finish_reason or result.finish_reason or "stop"
        metrics = result.metrics
        self._running.remove(job)
        self.metrics.request_finished(job, finish_reason, metrics)
        if self.on_request_finished is not None:
            try:
                self.on_request_finished(job, finish_reason, metrics)
            except Exception:
                logger.exception("specrs serve: the on_request_finished hook failed")
        job.ended = True
        job.send(Finished(finish_reason, job.num_completion_tokens, metrics))
