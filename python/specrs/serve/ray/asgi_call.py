"""One HTTP request through an ASGI app in this process, its response as a stream of messages.

A replica of `specrs serve --ray` runs the very Starlette app of `specrs serve` (serve/app.py) and
feeds it the requests the ingress forwards, so every route, error body, stream and per-request
`speculative` setting is the single server's, not a copy of it.

Invariants: the app sees the whole body at once, then (only) a disconnect once the caller stops
reading, is cancelled, or is done, so a forwarded request whose client went away is cancelled in
the app exactly as a direct one is; the app's lifespan runs once, startup before the first request.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

# How long an app that was told its client left may take to end its handler.
DRAIN_TIMEOUT_S = 5.0


def http_scope(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
            "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


async def call_app(app, scope: dict[str, Any], body: bytes) -> AsyncIterator[dict[str, Any]]:
    """Runs `app` on one request; yields its `http.response.start` and `http.response.body`
    messages as it sends them. Stopping the iteration (or cancelling the task iterating it) tells the
    app its client disconnected."""
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set():  # Starlette stops streaming once a send fails, as it would on a closed socket
            raise OSError("the client disconnected")
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        await task  # the handler's own exception, if any
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), DRAIN_TIMEOUT_S)
            task.cancel()


class Lifespan:
    """Runs an ASGI app's lifespan: `startup()` before the first request, `shutdown()` at the end."""

    def __init__(self, app):
        self.app = app
        self._to_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._from_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def _expect(self, event: str) -> None:
        message = await self._from_app.get()
        if message["type"] != f"lifespan.{event}.complete":
            raise RuntimeError(f"the app's lifespan {event} failed: {message.get('message', message['type'])}")

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.create_task(self.app(scope, self._to_app.get, self._from_app.put))
        await self._to_app.put({"type": "lifespan.startup"})
        await self._expect("startup")

    async def shutdown(self) -> None:
        if self._task is None:
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        await self._expect("shutdown")
        await self._task
        self._task = None


__all__ = ["Lifespan", "call_app", "http_scope"]
