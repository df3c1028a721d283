"""specrs's log: the `specrs` logger, which says on stderr what specrs is loading, measuring or
waiting for, so nothing that takes more than a second happens silently.

As vLLM does with its own logger, importing specrs gives the `specrs` logger a stderr handler at
INFO ("specrs: ..." lines) unless the application configures logging itself:
`SPECRS_CONFIGURE_LOGGING=0` leaves the logger alone (its records then go wherever the
application's root logger sends them), and `SPECRS_LOGGING_LEVEL` (default INFO) sets the level,
e.g. WARNING for silence.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("specrs")


def _configure() -> None:
    if os.environ.get("SPECRS_CONFIGURE_LOGGING", "1") == "0" or logger.handlers:
        return

    class _Stderr(logging.StreamHandler):
        """Writes to whatever sys.stderr is at the time (pytest and notebooks swap it)."""

        @property  # type: ignore[override]
        def stream(self):
            return sys.stderr

        @stream.setter
        def stream(self, _value) -> None:
            pass

    handler = _Stderr()
    handler.setFormatter(logging.Formatter("specrs: %(message)s"))
    logger.addHandler(handler)
    level = os.environ.get("SPECRS_LOGGING_LEVEL", "INFO").upper()
    logger.setLevel(level if isinstance(logging.getLevelName(level), int) else "INFO")
    logger.propagate = False


def enabled() -> bool:
    """Whether INFO lines are shown (the engine's background thread writes its own then)."""
    return logger.isEnabledFor(logging.INFO)


_configure()
