"""The suffix cache shared by the replicas of `specrs serve --ray`.

Each replica keeps its own engine-wide suffix cache (what `"method": "suffix"` drafts from); here,
every response a replica finishes with a suffix config (or an "auto" one, whose suffix lookup
keeps its own cache) also reaches every other replica's cache
for that config, so what one replica learned from the traffic speeds up the others. The shared
part is a bounded log of responses held by the app's coordinator (`SharedResponses`); each replica
(`ShareClient`) publishes its finished responses to it and pulls the others' every
`interval_s`, both in one call.

Staleness: a response is in a peer's cache at most about 2 x `interval_s` (default 1 s each) after
its request ended: one interval until its replica publishes, one until the peer pulls.
Memory: the log keeps the newest `max_responses` responses and `max_tokens` tokens (4 bytes a
token), once for the whole app; each replica's engine keeps its own cache as `specrs serve` does
(bounded by `suffix_decoding_max_cached_requests`). Network: each response travels once to the
coordinator and once to each other replica, 4 bytes a token.
Persistence (`--suffix-cache PATH`): the first replica to join an empty log loads the file (the
checks of `specrs serve --suffix-cache`) and seeds the log with it; the others take the log, so no
response is counted twice; every replica saves its cache, which holds the shared responses, to
PATH (atomically, each through its own temporary file), so the file survives a restart of the
whole application. A replica Ray restarts joins as a newcomer and receives the whole log.

Invariants: a replica never receives its own responses back; responses enter a peer's engine in
the order the coordinator received them, through `Engine.add_suffix_responses`, exactly as if the
peer had finished those requests (same eviction); a failed exchange loses nothing (the outbox is
sent again next time) and never stops serving; token ids travel as little-endian uint32 bytes.
"""

from __future__ import annotations

import array
import asyncio
import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass


logger = logging.getLogger("specrs.serve")

# As many responses as one suffix cache keeps by default (suffix_decoding_max_cached_requests).
DEFAULT_MAX_RESPONSES = 10_000
# 4 M tokens = 16 MB in the coordinator.
DEFAULT_MAX_TOKENS = 4_000_000
# A replica that claimed seeding but sent nothing for this long is presumed dead: the next one seeds.
SEED_LEASE_S = 300.0


def pack(tokens: list[int]) -> bytes:
    packed = array.array("I", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack(data: bytes) -> list[int]:
    unpacked = array.array("I")
    unpacked.frombytes(data)
    if sys.byteorder != "little":
        unpacked.byteswap()
    return unpacked.tolist()


@dataclass
class Entry:
    seq: int
    origin: str  # the replica that finished it, or that loaded it from the file
    config_json: str
    tokens: bytes


class SharedResponses:
    """The coordinator's log of responses, newest `max_responses` / `max_tokens` kept."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_tokens: int = DEFAULT_MAX_TOKENS,
                 clock=time.monotonic):
        if max_responses < 1 or max_tokens < 1:
            raise ValueError(f"the shared suffix log needs room: max_responses {max_responses}, max_tokens {max_tokens}")
        self.max_responses, self.max_tokens = max_responses, max_tokens
        self.entries: deque[Entry] = deque()
        self.next_seq = 0
        self.num_tokens = 0
        self.num_evicted = 0
        self.clock = clock
        self.seeded = False
        self.seeder: tuple[str, float] | None = None  # (replica, when it claimed)

    def join(self, replica: str, has_file: bool) -> str:
        """"seed" when `replica` should load the suffix cache file and `seed` the log with it (the
        first with a file to join an unseeded log), else "follow" (take the log)."""
        if not has_file or self.seeded:
            return "follow"
        now = self.clock()
        if self.seeder is None or now - self.seeder[1] > SEED_LEASE_S:
            self.seeder = (replica, now)
            return "seed"
        return "follow"

    def is_ready(self) -> bool:
        """Whether a follower may take the log: seeded, or nobody is seeding it."""
        return self.seeded or self.seeder is None or self.clock() - self.seeder[1] > SEED_LEASE_S

    def seed(self, replica: str, caches: list[tuple[str, list[bytes]]]) -> int:
        """The seeder's loaded file, as (config JSON, responses oldest first) per cache."""
        if self.seeded:
            return 0
        added = sum(self._append(replica, config, tokens) for config, responses in caches for tokens in responses)
        self.seeded, self.seeder = True, None
        return added

    def exchange(self, replica: str, published: list[tuple[str, bytes]], cursor: int) -> tuple[list[tuple[str, bytes]], int, int]:
        """Appends `replica`'s new responses; returns the others' responses from `cursor` on, the
        next cursor, and how many the replica missed because they were evicted before it pulled."""
        for config, tokens in published:
            self._append(replica, config, tokens)
        oldest = self.entries[0].seq if self.entries else self.next_seq
        missed = max(0, oldest - cursor)
        start = max(cursor, oldest) - oldest
        pulled = [(e.config_json, e.tokens) for i, e in enumerate(self.entries) if i >= start and e.origin != replica]
        return pulled, self.next_seq, missed

    def stats(self) -> dict:
        return {"num_responses": len(self.entries), "num_tokens": self.num_tokens, "bytes": 4 * self.num_tokens,
                "num_evicted": self.num_evicted, "seeded": self.seeded, "max_responses": self.max_responses,
                "max_tokens": self.max_tokens}

    def _append(self, origin: str, config: str, tokens: bytes) -> int:
        num_tokens = len(tokens) // 4
        if num_tokens == 0 or num_tokens > self.max_tokens:
            return 0
        self.entries.append(Entry(self.next_seq, origin, config, tokens))
        self.next_seq += 1
        self.num_tokens += num_tokens
        while len(self.entries) > self.max_responses or self.num_tokens > self.max_tokens:
            evicted = self.entries.popleft()
            self.num_tokens -= len(evicted.tokens) // 4
            self.num_evicted += 1
        return 1


def suffix_config_of(request) -> str | None:
    """The request's speculative config JSON (the key replicas share its responses under) when it
    drafts from a suffix cache ("suffix", and "auto"'s suffix lookup: Rust says which), else None."""
    config = request.speculative_config
    return config.to_json() if config is not None and config.keeps_suffix_cache else None


class ShareClient:
    """A replica's side: collects its finished suffix responses (`on_request_finished`, the
    scheduler's end-of-request hook, any thread) and exchanges them with the coordinator."""

    def __init__(self, coordinator, replica: str, engine, interval_s: float):
        self.coordinator, self.replica, self.engine = coordinator, replica, engine
        self.interval_s = interval_s
        self.cursor = 0
        self._outbox: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        # One exchange at a time (the periodic one, a save round's): two at once would pull the same
        # responses from one cursor and add them twice.
        self._exchanging = asyncio.Lock()
        self.num_published = 0
        self.num_received = 0
        self.num_missed = 0

    def on_request_finished(self, job, finish_reason: str, metrics: dict | None) -> None:
        config = suffix_config_of(job.request)
        if config is None or not job.response_ids:
            return
        with self._lock:
            self._outbox.append((config, pack(job.response_ids)))

    async def exchange(self) -> int:
        """One publish-and-pull; returns how many responses it added to the engine. On failure the
        outbox is kept for the next call."""
        async with self._exchanging:
            return await self._exchange()

    async def _exchange(self) -> int:
        with self._lock:
            outbox, self._outbox = self._outbox, []
        try:
            pulled, cursor, missed = await self.coordinator.share_exchange.remote(self.replica, outbox, self.cursor)
        except BaseException:
            with self._lock:
                self._outbox[:0] = outbox
            raise
        self.num_published += len(outbox)
        self.cursor = cursor
        if missed:
            self.num_missed += missed
            logger.warning("specrs serve: this replica missed %d shared suffix responses (evicted from the shared "
                           "log before it pulled them)", missed)
        return await asyncio.to_thread(self._add, pulled)

    def _add(self, pulled: list[tuple[str, bytes]]) -> int:
        """Adds pulled responses in order, a run of one config per call."""
        added, run_config, run = 0, None, []
        for config, tokens in pulled + [(None, b"")]:
            if config != run_config and run:
                try:
                    added += self.engine.add_suffix_responses(run_config, run)
                except Exception as e:  # another model's responses: logged, never fatal
                    logger.error("specrs serve: shared suffix responses refused: %s", e)
                run = []
            run_config = config
            if config is not None:
                run.append(unpack(tokens))
        self.num_received += len(pulled)
        return added

    async def run(self) -> None:
        """Exchanges every `interval_s` until cancelled; failures are logged and retried."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.exchange()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning("specrs serve: suffix cache exchange with the coordinator failed (retried in "
                               "%.1f s): %s", self.interval_s, e)

    def stats(self) -> dict:
        return {"num_published": self.num_published, "num_received": self.num_received, "num_missed": self.num_missed,
                "pending": len(self._outbox)}


__all__ = ["SharedResponses", "ShareClient", "pack", "unpack"]
