"""API-key authentication of `specrs serve --api-key KEY` (or `SPECRS_API_KEY`), as `vllm serve
--api-key` has it: every request must carry `Authorization: Bearer KEY`, except `GET /health` (load
balancers probe it) and, with `--metrics-public`, `GET /metrics` (scrapers).

Invariants: the key is compared in constant time (`hmac.compare_digest`), so the time of an answer
says nothing about how much of a guess was right; a refusal is a 401 with OpenAI's error body and
never reads the request body; the check runs before routing, so an unknown path gets the same 401
as a known one (no route list for anonymous clients).
"""

from __future__ import annotations

import hmac
import os

from ..errors import ConfigError

API_KEY_ENV = "SPECRS_API_KEY"
PUBLIC_PATHS = ("/health",)


def resolve_api_key(api_key: str | None) -> str | None:
    """The key the server requires: `api_key` when given, else `$SPECRS_API_KEY`, else None (no
    authentication). An empty key is refused: it would let every "Bearer " through."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ConfigError(f"the API key is empty; pass a non-empty --api-key (or {API_KEY_ENV}), or none to serve "
                          "without authentication")
    if key is not None and not key.isascii():
        raise ConfigError("the API key must be ASCII text (HTTP headers carry it)")
    return key


def public_paths(metrics_public: bool) -> tuple[str, ...]:
    return PUBLIC_PATHS + (("/metrics",) if metrics_public else ())


def is_authorized(authorization: bytes | None, api_key: str) -> bool:
    """Whether an `Authorization` header value carries `api_key` as its Bearer token."""
    scheme, _, token = (authorization or b"").partition(b" ")
    # Compared whatever the scheme, so a wrong scheme costs the same time as a wrong key.
    matches = hmac.compare_digest(token.strip(), api_key.encode())
    return scheme.lower() == b"bearer" and matches


def admits(method: str, path: str, headers: list[tuple[bytes, bytes]], api_key: str | None,
           public: tuple[str, ...]) -> bool:
    """Whether a request may go on: no key required, a public path, or the key in its headers
    (`headers` as ASGI has them: lower-case names)."""
    if api_key is None or (method in ("GET", "HEAD") and path in public):
        return True
    return is_authorized(next((value for name, value in headers if name == b"authorization"), None), api_key)


def unauthorized():
    """The 401 (a Starlette response): OpenAI's error body, with its code for a wrong key."""
    from starlette.responses import JSONResponse  # the serve extra; resolve_api_key needs none

    return JSONResponse({"error": {
        "message": "missing or incorrect API key: send the header `Authorization: Bearer <key>` with the key this "
                   "server was started with (--api-key or SPECRS_API_KEY)",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
        status_code=401, headers={"WWW-Authenticate": "Bearer"})


class ApiKeyMiddleware:
    """ASGI middleware: HTTP requests without the key get a 401 (`admits`)."""

    def __init__(self, app, api_key: str, public: tuple[str, ...] = PUBLIC_PATHS):
        self.app, self.api_key, self.public = app, api_key, public

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or admits(scope["method"], scope["path"], scope["headers"], self.api_key,
                                             self.public):
            await self.app(scope, receive, send)
        else:
            await unauthorized()(scope, receive, send)


__all__ = ["API_KEY_ENV", "ApiKeyMiddleware", "admits", "is_authorized", "public_paths", "resolve_api_key",
           "unauthorized"]
