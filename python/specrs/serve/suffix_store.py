"""`specrs serve --suffix-cache PATH`: the engine-wide suffix cache kept across restarts.

The server loads the file before it serves (so a bad file stops startup, not a request), saves it
every `save_every` finished requests and once more at shutdown, before anything is torn down
(serve/app.py's lifespan), so a shutdown cut short loses at most what ended after the last save.
The engine writes the file
atomically (a temporary file beside it, synced, renamed over it: `Engine.save_suffix_cache`), so a
crash mid-save leaves the previous file.

Invariants: a file that exists but cannot be used (corrupt, truncated, another model's) stops the
server unless it was told to start empty instead; a save never stops or fails the server (it is
logged); at most one save runs at a time, and the periodic ones run outside the generation thread,
so serving a big cache to disk never stalls the streams.
"""

from __future__ import annotations

import logging
import os
import threading

from ..errors import ConfigError

logger = logging.getLogger("specrs.serve")

# Finished requests between two saves (`--suffix-cache-save-every`). A save copies the responses and
# writes them (10,000 cached responses of ~300 tokens are ~12 MB); 100 requests keeps the loss on a
# crash small at a cost nobody notices.
DEFAULT_SAVE_EVERY = 100
# The flag that lets the server start without a usable file; refusals name it.
START_EMPTY_FLAG = "--suffix-cache-start-empty-on-error"


class SuffixCacheStore:
    """The suffix cache file of one engine. `save_every`: finished requests between saves."""

    def __init__(self, engine, path: str | os.PathLike[str], save_every: int = DEFAULT_SAVE_EVERY):
        if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
            raise ConfigError(f"suffix cache save_every must be at least 1 finished request (got {save_every!r})")
        self.engine = engine
        self.path = os.fspath(path)
        self.save_every = save_every
        self.num_finished = 0
        self.num_saves = 0  # successful ones, for tests and logs
        self._saving = threading.Lock()  # held by the one save in progress

    def load(self, allow_empty: bool = False) -> int:
        """Loads the file into the engine; returns how many responses it held. No file yet: the
        server starts empty (it is created at the first save). A file that cannot be used raises
        ConfigError naming the path and the flag, unless `allow_empty`, which starts empty with a
        warning (the file is replaced at the next save)."""
        if not os.path.lexists(self.path):
            logger.info("specrs serve: no suffix cache at %s yet; starting empty (it is written every %d requests "
                        "and at shutdown)", self.path, self.save_every)
            return 0
        try:
            loaded = self.engine.load_suffix_cache(self.path)
        except ConfigError as e:
            if not allow_empty:
                raise ConfigError(f"{e}; or pass {START_EMPTY_FLAG} to start with an empty cache") from None
            logger.warning("specrs serve: %s; starting with an empty suffix cache (%s), which replaces the file at "
                           "the next save", e, START_EMPTY_FLAG)
            return 0
        logger.info("specrs serve: loaded %d cached responses from %s", loaded, self.path)
        return loaded

    def on_request_finished(self, *_: object, **__: object) -> None:
        """Counts a finished request (the scheduler's arguments about it are not needed) and starts a
        save every `save_every` of them, in a background thread. Called in the generation thread,
        so it never blocks and never raises."""
        try:
            self.num_finished += 1
            if self.num_finished % self.save_every == 0:
                self._save_in_background()
        except Exception:  # a save must never end a request or the loop
            logger.exception("specrs serve: could not start saving the suffix cache to %s", self.path)

    def _save_in_background(self) -> None:
        if not self._saving.acquire(blocking=False):
            # A save is still writing; the next one includes these requests.
            return
        try:
            threading.Thread(target=self._save_and_release, name="specrs-suffix-cache-save", daemon=True).start()
        except BaseException:
            self._saving.release()
            raise

    def _save_and_release(self) -> None:
        try:
            self._save_now()
        finally:
            self._saving.release()

    def save(self) -> bool:
        """Saves now, after any save in progress (the server's shutdown calls it). Returns whether
        the file was written; a failure is logged, not raised."""
        with self._saving:
            return self._save_now()

    def wait(self) -> None:
        """Returns once no background save is running."""
        with self._saving:
            pass

    def _save_now(self) -> bool:
        try:
            saved = self.engine.save_suffix_cache(self.path)
        except Exception as e:
            logger.error("specrs serve: could not save the suffix cache to %s: %s", self.path, e)
            return False
        self.num_saves += 1
        logger.info("specrs serve: saved %d cached responses to %s", saved, self.path)
        return True


__all__ = ["DEFAULT_SAVE_EVERY", "START_EMPTY_FLAG", "SuffixCacheStore"]
