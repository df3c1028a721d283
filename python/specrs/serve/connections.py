"""The limits `specrs serve` puts on HTTP connections, below the app: how long a client may take to
send its request line and headers, and how many connections may be open at once.

uvicorn waits for headers without a deadline (a keep-alive timeout only runs between requests) and
accepts every connection, so 300 clients dribbling a header byte now and then held 300 sockets
open indefinitely. `limited_protocol` subclasses uvicorn's HTTP protocol (h11's or httptools',
whichever uvicorn picks) with:

- a header deadline: armed when a connection opens, and on a kept-alive connection when the first
  bytes of its next request arrive (until then uvicorn's keep-alive timeout closes it, silently);
  disarmed once a request's headers are complete; when it passes, the client gets a 408 with
  OpenAI's error body and the connection is closed;
- a connection limit: a connection beyond `max_connections` gets a 503 at once and is closed,
  so it holds nothing; the connections already open (running streams) are untouched.

The body has its own deadline, in the app (`app.read_body`), since the app reads it.

Invariant: a connection whose request is being served (headers complete, response not finished)
never has a header deadline armed, so no limit here cuts a running stream.
"""

from __future__ import annotations

import asyncio
import json

from .errors import APIError

# How long a client may take to send its request line and headers (uvicorn has no such limit).
DEFAULT_HEADER_TIMEOUT_S = 10.0
# How long a client may take to send its body once its headers are in (`app.read_body`).
DEFAULT_BODY_TIMEOUT_S = 60.0
# Open connections at once (each a socket, a file descriptor and a little memory); a running
# request holds one, as does each idle keep-alive connection for `--timeout-keep-alive` seconds.
DEFAULT_MAX_CONNECTIONS = 1000
# uvicorn's own default: an idle keep-alive connection is closed after this many seconds.
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP response that closes the connection, with OpenAI's error body."""
    body = json.dumps(APIError(status, message, code=code).body()).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def limited_protocol(header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with a header deadline and a connection limit (pass it as
    uvicorn's `http`)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    timed_out = _raw_response(408, "Request Timeout", f"the request line and headers did not arrive within "
                              f"{header_timeout_s:g} s; send them at once (`specrs serve --header-timeout`)",
                              "request_timeout")
    too_many = _raw_response(503, "Service Unavailable", f"this server has {max_connections} connections open, "
                             "its limit (`specrs serve --max-connections`); retry later", "too_many_connections")

    class LimitedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)  # counts this connection in self.connections
            self._header_deadline: asyncio.TimerHandle | None = None
            self._armed_after = None  # the request cycle that was current when the deadline was armed
            if len(self.connections) > max_connections:
                transport.write(too_many)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._armed_after = self.cycle
            self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_late(self) -> None:
            self._header_deadline = None
            if not self.transport.is_closing():
                self.transport.write(timed_out)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            # Bytes while no request is being served start the next one: its headers have a deadline.
            if self._header_deadline is None and self.cycle is not None and self.cycle.response_complete:
                self._arm()
            super().data_received(data)
            # Complete headers start a new request cycle: from then on the request is the app's.
            if self._header_deadline is not None and self.cycle is not self._armed_after:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return LimitedHTTPProtocol


__all__ = ["DEFAULT_BODY_TIMEOUT_S", "DEFAULT_HEADER_TIMEOUT_S", "DEFAULT_KEEP_ALIVE_TIMEOUT_S",
           "DEFAULT_MAX_CONNECTIONS", "limited_protocol"]
