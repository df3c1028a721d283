"""The HTTP routes of `specrs serve` (Starlette on uvicorn), OpenAI's API shape.

Invariants: a request's HTTP status is decided before any body is sent (the handler waits until the
scheduler admits it, so a setting only the engine can check still gets a 400); every error body is
OpenAI's; a client that goes away, while queued, waiting or mid-stream, cancels its generation.
Nothing a request sends runs unbounded on the event loop: its body is read up to
`max_request_body_bytes` (413 past it) within `body_timeout_s` (408 past it, and the connection is
closed), and parsing, tokenization and chat-template rendering run in a worker thread, so /health
answers while a huge prompt is tokenized. With an `api_key`, every route but /health (and /metrics
with `metrics_public`) answers 401 to a request without it (auth.py). Error bodies carry a message
and never a backtrace or the server's paths; /v1/models names the served model, not its file.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from typing import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine import DEFAULT_DRAFT_BUDGET, DEFAULT_MAX_NUM_BATCHED_TOKENS, Engine
from .auth import ApiKeyMiddleware, public_paths
from .connections import DEFAULT_BODY_TIMEOUT_S
from .generation_config import with_defaults
from .tools import CallStream, parse_call
from .metrics import ServerMetrics
from .protocol import (APIError, GenerationRequest, ServerSpeculation, answer_choice, chunk_body, logprobs_body,
                       merged_metrics, parse_json_body, parse_request, request_too_large, response_body, usage)
from .scheduler import Failed, Finished, Job, Scheduler, Text
from .suffix_store import DEFAULT_SAVE_EVERY, SuffixCacheStore
from .traffic import TrafficRecorder

logger = logging.getLogger("specrs.serve")

# How often a handler waiting on the scheduler checks that its client is still there.
DISCONNECT_POLL_S = 0.25


def error_response(error: APIError) -> JSONResponse:
    # After a 408 the rest of the body may still be on its way: the connection is not reused.
    headers = {"Connection": "close"} if error.status == 408 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


async def read_body(http_request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, refused with a 413 once it is over `limit` bytes: a declared Content-Length over it
    before anything is read, and a body without one (chunked) as soon as its bytes pass it; and
    with a 408 when all of it has not arrived `timeout_s` seconds after the handler began reading."""
    declared = http_request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise APIError(400, f"Content-Length must be a number of bytes (got {declared[:40]!r})")
        if int(declared) > limit:
            raise request_too_large(limit, f"{declared[:40]} bytes")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in http_request.stream():
            size += len(chunk)
            if size > limit:
                raise request_too_large(limit, f"over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s; send it at once "
                       "(`specrs serve --body-timeout`)", code="request_timeout") from None


def build_app(engine: Engine, served_model_name: str, max_num_seqs: int, prefill_chunk: int | None,
              max_request_body_bytes: int, default_max_tokens: int, suffix_cache: str | None = None,
              suffix_cache_save_every: int = DEFAULT_SAVE_EVERY,
              suffix_cache_start_empty_on_error: bool = False, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
              max_kv_tokens: int | None = None, draft_budget: str = DEFAULT_DRAFT_BUDGET,
              record_traffic: str | None = None, suffix_cache_load: bool = True,
              extra_hooks: tuple = (), api_key: str | None = None, metrics_public: bool = False,
              body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
              generation_defaults: dict | None = None) -> Starlette:
    """The server for `engine`; its `speculative_config` (and `proposer`) are every request's default.
    `suffix_cache`: a file the engine-wide suffix cache is loaded from now (a bad file raises
    ConfigError here, so the server never starts on it, unless `suffix_cache_start_empty_on_error`)
    and saved to every `suffix_cache_save_every` finished requests and at shutdown (with
    `suffix_cache_load` False it is only saved to: a replica that takes its cache from its peers).
    `extra_hooks`: more end-of-request hooks (job, finish_reason, metrics). `api_key`: the key every
    route but /health (and /metrics with `metrics_public`) requires as `Authorization: Bearer`.
    `body_timeout_s`: a request body must arrive within this many seconds (None: no limit).
    `generation_defaults`: request fields a request without them takes (generation_config.py)."""
    speculation = ServerSpeculation(engine.speculative_config, has_proposer=engine.proposer is not None,
                                    target_info=engine.info())

    def answered_call(request: GenerationRequest, text: str, finish_reason: str | None) -> dict | None:
        """The tool call a finished answer makes (None: a text answer, or one cut by max_tokens)."""
        if request.tools is None or finish_reason != "stop":
            return None
        return parse_call(text, request.tools)

    @functools.lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        """One token's text for logprobs (special tokens spelled out, as vLLM shows them)."""
        return engine.tokenizer.decode([token_id], skip_special_tokens=False)
    metrics = ServerMetrics(served_model_name)
    store = None
    if suffix_cache is not None:
        store = SuffixCacheStore(engine, suffix_cache, suffix_cache_save_every)
        if suffix_cache_load:
            store.load(allow_empty=suffix_cache_start_empty_on_error)
    hooks = [store.on_request_finished] if store is not None else []
    hooks.extend(extra_hooks)
    if record_traffic is not None:  # opt-in: stores every prompt and output (serve/traffic.py)
        hooks.append(TrafficRecorder(record_traffic).on_request_finished)

    def on_request_finished(job, finish_reason, request_metrics):
        for hook in hooks:  # one hook's failure must not skip the others
            try:
                hook(job, finish_reason, request_metrics)
            except Exception:
                logger.exception("specrs serve: an end-of-request hook failed")

    scheduler = Scheduler(engine, metrics, max_num_seqs, prefill_chunk,
                          on_request_finished=on_request_finished if hooks else None,
                          max_num_batched_tokens=max_num_batched_tokens, max_kv_tokens=max_kv_tokens,
                          draft_budget=draft_budget)
    metrics.report_queue(lambda: scheduler.num_running, lambda: scheduler.num_waiting)
    metrics.report_costs(engine.cost_status)
    metrics.report_step_graphs(engine.step_graph_status)
    context_length = engine.info()["context_length"]

    def cancel(samples: list[Job]) -> None:
        for job in samples:
            scheduler.cancel(job)

    async def cancel_on_disconnect(samples: list[Job], http_request: Request) -> None:
        """Cancels a request's samples once its client goes away; the scheduler then ends them."""
        while not await http_request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        cancel(samples)

    def final_usage(request: GenerationRequest, ended: dict[int, Finished]) -> dict:
        """The usage of the samples that ended: the prompt once, their tokens and acceptance summed."""
        return usage(len(request.prompt_ids), sum(e.num_completion_tokens for e in ended.values()),
                     merged_metrics([e.metrics for e in ended.values()]))

    async def generate(http_request: Request, kind: str) -> Response:
        try:
            body = with_defaults(parse_json_body(await read_body(http_request, max_request_body_bytes,
                                                                 body_timeout_s)),
                                 generation_defaults or {})
            # Tokenizing a long prompt (or rendering a long chat) takes a while: not on the event loop.
            request = await asyncio.to_thread(parse_request, kind, body, engine, served_model_name, speculation,
                                              default_max_tokens)
        except APIError as e:
            return error_response(e)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            return Response(status_code=499)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()  # every sample's events, each naming its sample
        samples = [Job(request, loop, events, index=i) for i in range(request.n)]
        scheduler.submit(samples)
        # Until the response starts (a stream's body watches for disconnects itself).
        watcher = asyncio.create_task(cancel_on_disconnect(samples, http_request))
        try:
            event = await events.get()
            if isinstance(event, Failed):
                return error_response(event.error)
            if isinstance(event, Finished):  # cancelled while queued: nobody is listening
                return Response(status_code=499)
            if request.stream:
                return StreamingResponse(stream_events(samples, events, request), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            texts: list[list[str]] = [[] for _ in samples]
            entries: list[list] = [[] for _ in samples]
            ended: dict[int, Finished] = {}
            while len(ended) < len(samples):
                event = await events.get()
                if isinstance(event, Text):
                    texts[event.index].append(event.text)
                    entries[event.index].extend(event.logprobs or [])
                elif isinstance(event, Finished):
                    ended[event.index] = event
                else:  # one sample failed: so does the request
                    cancel(samples)
                    return error_response(event.error)
            choices = []
            for index, done in sorted(ended.items()):
                text = "".join(texts[index])
                call = answered_call(request, text, done.finish_reason)
                choices.append(answer_choice(request, index, text, "tool_calls" if call else done.finish_reason,
                                             logprobs_body(request, entries[index], token_text), tool_call=call,
                                             stop_reason=done.stop_reason))
            return JSONResponse(response_body(request, choices, final_usage(request, ended)))
        except asyncio.CancelledError:
            cancel(samples)
            raise
        finally:
            watcher.cancel()

    async def stream_events(samples: list[Job], events: asyncio.Queue,
                            request: GenerationRequest) -> AsyncIterator[str]:
        """The chunks of every sample as they come (each names its choice `index`); one sample's
        end is its finish chunk, the last one's also carries the usage of all."""
        done = False
        ended: dict[int, Finished] = {}
        text_offsets = [0] * len(samples)  # completions' logprobs.text_offset
        num_tokens = [0] * len(samples)  # for continuous_usage_stats
        held: list[tuple[list, list]] = [([], []) for _ in samples]  # "auto" tool answers, held until complete
        constrained = request.tools is not None and request.tools.choice != "auto"
        calls = [CallStream() if constrained else None for _ in samples]  # constrained calls, streamed
        try:
            if request.kind == "chat":  # OpenAI's first chat chunk (of each choice) carries the role
                running = usage(len(request.prompt_ids), 0, None) if request.continuous_usage else None
                for index in range(len(samples)):
                    yield _sse(chunk_body(request, "", usage_=running, first=True, index=index))
            while len(ended) < len(samples):
                event = await events.get()
                index = event.index
                call_stream = calls[index]
                if isinstance(event, Text) and call_stream is not None:
                    for delta in call_stream.feed(event.text):
                        yield _sse(chunk_body(request, None, tool_call=delta, index=index))
                elif isinstance(event, Text) and request.tools is not None:
                    held[index][0].append(event.text)
                    held[index][1].extend(event.logprobs or [])
                elif isinstance(event, Text):
                    num_tokens[index] = event.num_completion_tokens
                    running = None
                    if request.continuous_usage:  # vLLM's continuous_usage_stats: the counts so far
                        running = usage(len(request.prompt_ids), sum(num_tokens), None)
                    logprobs = logprobs_body(request, event.logprobs, token_text, text_offsets[index])
                    text_offsets[index] += len(event.text)
                    yield _sse(chunk_body(request, event.text, usage_=running, logprobs=logprobs, index=index))
                elif isinstance(event, Finished):
                    ended[index] = event
                    finish_reason = event.finish_reason
                    if call_stream is not None and call_stream.started:
                        complete = answered_call(request, call_stream.text, finish_reason) is not None
                        for delta in call_stream.finish(complete):
                            yield _sse(chunk_body(request, None, tool_call=delta, index=index))
                        finish_reason = "tool_calls" if complete else finish_reason
                    elif call_stream is not None and call_stream.text:  # cut before it named a function
                        yield _sse(chunk_body(request, call_stream.text, index=index))
                    elif request.tools is not None:
                        text, entries = "".join(held[index][0]), held[index][1]
                        call = answered_call(request, text, finish_reason)
                        if call is not None:  # OpenAI's deltas: id, type and name, then the arguments
                            first_delta = {"index": 0, "id": call["id"], "type": "function",
                                           "function": {"name": call["function"]["name"], "arguments": ""}}
                            yield _sse(chunk_body(request, None, tool_call=first_delta, index=index))
                            yield _sse(chunk_body(request, None, tool_call={
                                "index": 0, "function": {"arguments": call["function"]["arguments"]}}, index=index))
                            finish_reason = "tool_calls"
                        elif text or entries:
                            yield _sse(chunk_body(request, text, logprobs=logprobs_body(request, entries, token_text),
                                                  index=index))
                    yield _sse(chunk_body(request, None if request.kind == "chat" else "", finish_reason,
                                          final_usage(request, ended), index=index, stop_reason=event.stop_reason))
                else:  # the status line went out with the first chunk: the error is an event, as in vLLM
                    done = True
                    cancel(samples)
                    yield _sse(event.error.body())
                    yield _sse("[DONE]")
                    return
            done = True
            if request.include_usage:
                yield _sse(chunk_body(request, None, usage_=final_usage(request, ended), no_choices=True))
            yield _sse("[DONE]")
        finally:
            if not done:  # the client went away mid-stream
                cancel(samples)

    async def completions(http_request: Request) -> Response:
        return await generate(http_request, "completion")

    async def chat_completions(http_request: Request) -> Response:
        return await generate(http_request, "chat")

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "specrs",
            # vLLM's "root" is the model's path; here the name, so no client learns the file system.
            "root": served_model_name, "max_model_len": context_length,
        }]})

    async def health(_: Request) -> Response:
        queue = {"num_requests_running": scheduler.num_running, "num_requests_waiting": scheduler.num_waiting}
        if scheduler.failure is not None:  # the generation thread died: nothing will be served
            return JSONResponse({"status": "unhealthy", "reason": f"the generation loop stopped: {scheduler.failure}",
                                 **queue}, status_code=503)
        return JSONResponse({"status": "ok", **queue})

    async def prometheus(_: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def http_error(_: Request, exc: HTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(APIError(exc.status_code, f"{exc.detail}: see /v1/models, /v1/completions, "
                                       "/v1/chat/completions, /health and /metrics", code=code))

    async def internal_error(_: Request, exc: Exception) -> Response:
        """A bug in a handler: OpenAI's 500 body (uvicorn still logs the traceback)."""
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette):
        scheduler.start()
        yield
        # What must persist first, then the teardown: a shutdown cut short (a second Ctrl-C, a Ray
        # replica killed past its grace period) then loses nothing that ended before it began. The
        # server drained its requests before this (uvicorn and Ray Serve both do), so the file has
        # every response; the save is atomic (a temporary file renamed over the old one).
        if store is not None:
            await asyncio.to_thread(store.save)
        scheduler.stop()

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
        middleware=[] if api_key is None else [Middleware(ApiKeyMiddleware, api_key=api_key,
                                                          public=public_paths(metrics_public))],
    )
    app.state.scheduler = scheduler  # for tests and embedding code that inspects the queue
    app.state.suffix_cache_store = store
    app.state.metrics = metrics
    return app
