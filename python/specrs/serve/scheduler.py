"""The server's one generation thread: feeds requests to the core's continuous-batching scheduler
and turns each step's tokens into events for the HTTP handlers.

Every step runs ONE target forward over all running requests (their newest tokens and drafts, and
chunks of prompts still being read), with drafts budgeted by load (`specrs_core::Scheduler`,
engine/scheduler.rs; policy in its header). The step runs in Rust with the GIL released, which
keeps the HTTP event loop (health, metrics, new requests) responsive meanwhile.

A request with `n` > 1 is one `Job` per sample, submitted together: the core runs them as
separate requests sharing the prompt's prefill (`Scheduler.add_samples`), and every event names
its sample (`index`), in one queue the handler reads.

Invariants: a request's tokens are exactly those it would get alone (batching changes no logits
and the budget only cuts drafts that cannot change a request's tokens); every submitted sample
ends with one `Finished` or `Failed` event (a request refused or cancelled before it was added
gets one for all its samples); a cancelled request is aborted in the core before its
next step, which frees its caches. Nothing one request does stops the others: a failure in one
request's admission or step ends that request alone with a 500 and `finished_reason="error"` (a bad
setting only the engine can see is a 400), and the loop goes on. Should the loop itself ever die,
`failure` says why (/health answers 503), every request in it fails, and later ones are refused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .. import _specrs
from ..engine import DEFAULT_DRAFT_BUDGET, DEFAULT_MAX_NUM_BATCHED_TOKENS, Engine
from .metrics import ServerMetrics
from .errors import APIError, api_error_from
from .protocol import GenerationRequest

logger = logging.getLogger("specrs.serve")


# Every event carries `index`, the sample it is about (`Job.send` sets it; 0 unless n > 1).
@dataclass
class Started:
    """The request was accepted by the scheduler: the HTTP response may begin."""
    index: int = 0


@dataclass
class Text:
    text: str
    num_completion_tokens: int = 0  # tokens generated so far (stream_options.continuous_usage_stats)
    logprobs: list | None = None  # the engine's entries of the tokens behind `text` (when asked for)
    index: int = 0


@dataclass
class Finished:
    finish_reason: str
    num_completion_tokens: int
    metrics: dict
    index: int = 0
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it


@dataclass
class Failed:
    error: APIError
    index: int = 0


@dataclass
class Job:
    """One sample of a request on its way through the scheduler; events reach the handler's asyncio
    queue (one queue for all the samples of a request)."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int = 0  # which of the request's n samples
    arrival_s: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    request_id: int | None = None  # its id in the core scheduler once added
    # Why it is being ended early ("abort"): the core's abort comes back on the next step.
    ending: str | None = None
    admitted: bool = False  # it had rows in a forward (queue time observed)
    admitted_s: float | None = None  # when it first had rows in a forward
    first_token_s: float | None = None  # when its first token came
    num_completion_tokens: int = 0
    response_ids: list[int] = field(default_factory=list)  # every token the target wrote for it
    # Logprob entries of tokens whose text the core still holds back (a possible stop string, an
    # incomplete character): sent with that text.
    pending_logprobs: list = field(default_factory=list)
    last_token_s: float | None = None
    ended: bool = False  # its Finished or Failed event was sent

    def send(self, event: Any) -> None:
        event.index = self.index
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (server shutdown): nobody is listening
            pass


def _is_fatal(error: BaseException) -> bool:
    """Exceptions a per-request handler must not swallow. Everything else, including PyO3's
    PanicException (a BaseException), ends one request only."""
    return isinstance(error, (KeyboardInterrupt, SystemExit))


class Scheduler:
    """`max_num_seqs` requests run at once, `max_num_batched_tokens` rows per forward,
    `max_kv_tokens` target KV positions among them (None: no bound but each context), prompts fed
    `prefill_chunk` rows per step; `draft_budget` "load" spends draft rows where they pay at the
    current batch size, "off" gives every request the draft it would take alone. `cost_curve_s`
    pins the budget's batch cost curve (None: the engine's, measured or read from its cache)."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, max_num_seqs: int, prefill_chunk: int | None,
                 on_request_finished=None, *, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, max_kv_tokens: int | None = None,
                 draft_budget: str = DEFAULT_DRAFT_BUDGET, cost_curve_s: list[float] | None = None):
        self.engine, self.metrics = engine, metrics
        self.core = _specrs.Scheduler(engine._inner, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens, max_kv_tokens=max_kv_tokens,
                                      prefill_chunk=prefill_chunk, draft_budget=draft_budget,
                                      cost_curve_s=cost_curve_s)
        # Called (job, finish_reason, metrics) after each request that ran ends (the suffix cache
        # store saves every N); whatever it raises is logged, never the request's or the loop's end.
        self.on_request_finished = on_request_finished
        self._ids = itertools.count()
        self._submitted: deque[list[Job]] = deque()  # requests (their samples) not yet added to the core
        self._jobs: dict[int, Job] = {}  # in the core, by request id
        self._num_running = 0
        self._num_waiting = 0
        self._wake = threading.Condition()
        self._stopping = False
        # Why the loop died ("ExceptionType: message"); None while it runs.
        self.failure: str | None = None
        # On CUDA a launched step runs on the device while the loop turns the step before's
        # outputs into events and adds new requests (`_steps`); on the CPU the forward runs
        # inside `launch`, so the outputs go out at once.
        self.overlap = self.core.launches_asynchronously
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
        """Requests not yet running: submitted, or queued in the core (as of the last step)."""
        return len(self._submitted) + self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    def submit(self, samples: list[Job]) -> None:
        """Queues a request: its samples' jobs (one unless n > 1), added to the core together."""
        with self._wake:
            if self.failure is None:
                self._submitted.append(samples)
                self._wake.notify()
                return
        for job in samples:
            job.ended = True
        samples[0].send(Failed(APIError(503, "the server cannot generate: its generation loop stopped "
                                        f"({self.failure}); restart it", code="service_unavailable")))

    def cancel(self, job: Job) -> None:
        """Stops `job` before its next step (the client went away)."""
        with self._wake:
            job.cancelled = True
            self._wake.notify()

    def _loop(self) -> None:
        try:
            self._steps()
        except BaseException as e:  # a bug outside any one request: say so on /health, fail everyone
            with self._wake:
                self.failure = f"{type(e).__name__}: {e}"
                jobs = list(self._jobs.values()) + [samples[0] for samples in self._submitted]
                self._jobs.clear()
                self._submitted.clear()
            logger.exception("specrs serve: the generation loop stopped; /health now answers 503")
            for job in jobs:
                self._fail(job, e, status=503)

    def _steps(self) -> None:
        """The generation loop. Each step is the core's `launch`, then its `finish`; with `overlap`
        a finished step's outputs are held and sent while the next step runs on the device, and
        requests submitted or cancelled meanwhile are taken then too. Nothing the step in flight
        has not produced is read: the core plans a step only after the one before finished."""
        held: tuple | None = None  # a finished step's (outputs, report, seconds), sent during the next
        while True:
            submitted = self._next_submissions(block=held is None)
            if submitted is None:
                if held is not None:
                    self._emit(*held)
                for job in list(self._jobs.values()):
                    self._abort(job, "abort")
                while self.core.has_unfinished:  # returns the aborted requests' ends
                    self._emit(*self._step())
                return
            self._take(submitted)
            if not self.core.has_unfinished:
                if held is not None:
                    self._emit(*held)
                    held = None
                continue
            start_s = time.perf_counter()
            self.core.launch()
            launch_s = time.perf_counter() - start_s
            if held is not None:  # while the device runs the launched step
                self._emit(*held)
                held = None
                self._take(self._next_submissions(block=False) or [])
            finish_start_s = time.perf_counter()
            outputs, report = self.core.finish()
            step = (outputs, report, launch_s + time.perf_counter() - finish_start_s)
            if self.overlap:
                held = step
            else:
                self._emit(*step)

    def _take(self, submitted: list[list[Job]]) -> None:
        """Adds the submitted requests to the core and aborts the cancelled ones."""
        for samples in submitted:
            self._guarded(samples[0], lambda _: self._add(samples))
        for job in list(self._jobs.values()):
            if job.cancelled:
                self._guarded(job, lambda j: self._abort(j, "abort"))

    def _next_submissions(self, block: bool = True) -> list[list[Job]] | None:
        """The jobs submitted since the last call, waiting for work first if `block` (None: the
        server is stopping)."""
        with self._wake:
            while block and not self._submitted and not self._jobs and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            submitted = list(self._submitted)
            self._submitted.clear()
            return submitted

    def _guarded(self, job: Job, action) -> None:
        """Runs `action(job)`; whatever it raises ends `job` alone."""
        try:
            action(job)
        except BaseException as e:
            if _is_fatal(e):
                raise
            self._fail(job, e)

    def _fail(self, job: Job, error: BaseException, status: int | None = None, metrics: dict | None = None) -> None:
        """Ends `job` after `error`: it is aborted in the core if it still runs there (freeing its
        caches), counted with finished_reason "error", and its client gets the error (a 500 for
        internal faults)."""
        if job.request_id in self._jobs:
            try:
                self.core.abort(job.request_id)  # False when the core already ended it
            except BaseException as e:  # the request still ends
                if _is_fatal(e):
                    raise
        self._forget(job)
        if job.ended:
            return
        job.ended = True
        api_error = api_error_from(error) if status is None else APIError(
            status, f"the generation loop stopped: {type(error).__name__}: {error}", code="service_unavailable")
        if api_error.status >= 500:
            self.metrics.request_finished(job, "error", metrics)
        job.send(Failed(api_error))

    def _forget(self, job: Job) -> None:
        if job.request_id is not None:
            self._jobs.pop(job.request_id, None)

    def _add(self, samples: list[Job]) -> None:
        """Adds a request's samples to the core; one `Started` (or one refusal) answers them all."""
        first = samples[0]
        if any(job.cancelled for job in samples):  # its client left while it waited
            self.metrics.request_finished(first, "abort", None)
            for job in samples:
                job.ended = True
            first.send(Finished("abort", 0, {}))
            return
        request = first.request
        request_ids = [next(self._ids) for _ in samples]
        # An exception here is a bad setting only the engine can see (a 400, e.g. exit_layer out of
        # range, a prompt over max_kv_tokens) or an internal fault (a 500); `_guarded` sends it.
        config = False if request.speculative_config is None else request.speculative_config
        config, proposer = self.engine._speculation(config, None)
        if len(samples) > 1:
            self.core.add_samples(request_ids, request.prompt_ids, request.params, config, proposer)
        else:
            self.core.add(request_ids[0], request.prompt_ids, request.params, config, proposer)
        for job, request_id in zip(samples, request_ids):
            job.request_id = request_id
            self._jobs[request_id] = job
        first.send(Started())

    def _abort(self, job: Job, reason: str) -> None:
        """Asks the core to end `job`; its end (with its metrics) comes back from the next step. A
        job the core already ended (its end held for sending) keeps its own finish reason."""
        if job.ending is None and self.core.abort(job.request_id):
            job.ending = reason

    def _step(self) -> tuple:
        """One whole core step (the batched forward, GIL released): (outputs, report, seconds)."""
        start_s = time.perf_counter()
        outputs, report = self.core.step()
        return outputs, report, time.perf_counter() - start_s

    def _emit(self, outputs: list[dict], report: dict, seconds: float) -> None:
        """A step's report into the metrics, and its outputs into their jobs' events."""
        self._num_running, self._num_waiting = report["num_running"], report["num_waiting"]
        self.metrics.scheduler_step(report, seconds)
        now = time.perf_counter()
        for output in outputs:
            job = self._jobs.get(output["request_id"])
            if job is not None:
                self._guarded(job, lambda j: self._output(j, output, now))

    def _output(self, job: Job, output: dict, now: float) -> None:
        if output["error"] is not None:
            self._fail(job, output["error"], metrics=(output["finished"] or {}).get("metrics"))
            return
        if not job.admitted:
            job.admitted, job.admitted_s = True, now
            self.metrics.request_admitted(now - job.arrival_s)
        token_ids, finished = output["token_ids"], output["finished"]
        if job.ending is None:
            if token_ids:
                if job.last_token_s is None:
                    job.first_token_s = now
                    self.metrics.first_token(now - job.arrival_s)
                else:
                    self.metrics.next_tokens(now - job.last_token_s)
                job.last_token_s = now
                job.num_completion_tokens += len(token_ids)
                job.response_ids.extend(token_ids)
            job.pending_logprobs.extend(output["logprobs"])
            # The core holds back text that may begin a stop string, and ends the request at one.
            if output["text"] or (finished is not None and job.pending_logprobs):
                job.send(Text(output["text"], job.num_completion_tokens, self._take_logprobs(job)))
        if finished is not None:
            self._end(job, finished, job.ending)

    @staticmethod
    def _take_logprobs(job: Job) -> list | None:
        if not job.request.logprobs:
            return None
        taken, job.pending_logprobs = job.pending_logprobs, []
        return taken

    def _end(self, job: Job, result: dict, finish_reason: str | None = None) -> None:
        """Ends a job; `finish_reason` overrides the engine's (an abort)."""
        finish_reason = finish_reason or result["finish_reason"] or "stop"
        metrics = result["metrics"]
        self._forget(job)
        self.metrics.request_finished(job, finish_reason, metrics)
        if self.on_request_finished is not None:
            try:
                self.on_request_finished(job, finish_reason, metrics)
            except Exception:
                logger.exception("specrs serve: the on_request_finished hook failed")
        job.ended = True
        job.send(Finished(finish_reason, job.num_completion_tokens, metrics, stop_reason=result.get("stop_reason")))
