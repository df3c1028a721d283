"""The server's refusals: `APIError` (an HTTP status plus OpenAI's error body) and the mapping of
engine exceptions to it.

Invariant: every refusal the server sends is an APIError, whose message and `param` are bounded
(a megabyte field never comes back as a megabyte answer); the modules that parse requests
(protocol.py, tools.py) import it from here, so neither imports the other for it.
"""

from __future__ import annotations

from ..errors import ConfigError, ContextLengthError, SpecrsError

# The most characters of a client's value an error message quotes (`_shown`), and of a whole error
# message: a megabyte field must not come back as a megabyte answer (or log line).
MAX_QUOTED_CHARS = 80
MAX_ERROR_MESSAGE_CHARS = 2000


class APIError(Exception):
    """A request the server refuses: HTTP status plus OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        if len(message) > MAX_ERROR_MESSAGE_CHARS:  # every quote is short; this bounds what nobody foresaw
            message = message[:MAX_ERROR_MESSAGE_CHARS - 3] + "..."
        if param is not None and len(param) > MAX_QUOTED_CHARS:
            param = param[:MAX_QUOTED_CHARS - 3] + "..."
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "internal_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error_from(error: Exception, param: str | None = None) -> APIError:
    """The HTTP answer for an engine exception: bad settings are the client's (400), anything else
    is the server's (500)."""
    if isinstance(error, ContextLengthError):
        return APIError(400, str(error), param="messages" if param is None else param, code="context_length_exceeded")
    if isinstance(error, ConfigError):
        return APIError(400, str(error), param=param)
    if isinstance(error, SpecrsError):
        return APIError(500, f"{type(error).__name__}: {error}")
    return APIError(500, f"internal error: {type(error).__name__}: {error}")
