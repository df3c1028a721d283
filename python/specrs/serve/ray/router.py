"""Prefix-affinity routing for `specrs serve --ray`: a request that continues a conversation, or
repeats or extends a prompt, goes to the replica that served it before, unless that replica is
overloaded, so the replica's suffix cache and draft state are warm for it.

The ingress names each request's affinity keys (`affinity_keys`): for a chat, one per prefix of
its messages that holds a non-system message (a shared system prompt alone must not pin every
user to one replica); for a completion, one per `BLOCK_CHARS` characters of its prompt and the
whole prompt. The router (a Ray Serve `RequestRouter`, one per ingress replica) remembers the
replica of each key it routed (newest `max_keys`) and sends a request to the replica of its
longest known key when that replica has at most `max_imbalance` more requests in flight than the
least loaded one; otherwise (and for a request with no known key) Ray Serve's power of two choices.
A request with an `x-specrs-replica` header (the header every response carries) goes to that
replica while it is alive, whatever its load: a client can stay on one replica, and tests can
address one. Such a request waits for its replica (Ray Serve retries with backoff while the replica
is full or slow to answer its queue-length probe, as a loaded machine makes it); a replica this
router has not seen yet (it learns the replica set a moment after the replicas report healthy) is
waited for up to `PIN_WAIT_S`; one it saw leave is not waited for.

Invariants: routing never changes what a request generates (every replica runs the same model and
settings); a replica that died or left is never chosen from memory; the memory is bounded.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

BLOCK_CHARS = 256
DEFAULT_MAX_KEYS = 100_000
DEFAULT_MAX_IMBALANCE = 4
PIN_WAIT_S = 5.0  # how long a request waits for a named replica this router has never seen


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def affinity_keys(path: str, body: Any) -> list[str]:
    """The request's affinity keys, shortest prefix first (empty for anything but a generation)."""
    if not isinstance(body, dict):
        return []
    if path.endswith("/chat/completions") and isinstance(body.get("messages"), list):
        keys, prefix, has_turn = [], [], False
        for message in body["messages"]:
            prefix.append(json.dumps(message, sort_keys=True))
            has_turn = has_turn or not (isinstance(message, dict) and message.get("role") in ("system", "developer"))
            if has_turn:
                keys.append(_digest("chat\n" + "\n".join(prefix)))
        return keys
    if path.endswith("/completions") and isinstance(body.get("prompt"), (str, list)):
        prompt = body["prompt"]
        if isinstance(prompt, list):
            if len(prompt) != 1:  # a batch of prompts: no single conversation
                return []
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        ends = list(range(BLOCK_CHARS, len(text), BLOCK_CHARS)) + [len(text)]
        return [_digest(f"completion\n{text[:end]}") for end in ends if end > 0]
    return []


class PrefixAffinityRouter(RequestRouter):
    """Configured with `request_router_kwargs` {"max_imbalance": N, "max_keys": M}."""

    def initialize_state(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE, max_keys: int = DEFAULT_MAX_KEYS,
                         **_: Any) -> None:
        self.max_imbalance = max_imbalance
        self.max_keys = max_keys
        self.replica_of: OrderedDict[str, ReplicaID] = OrderedDict()
        self.num_affine = 0  # requests sent to their remembered replica
        self.num_spread = 0  # requests routed by load alone
        self.seen_replicas: set[str] = set()  # unique ids of every replica ever a candidate
        self.pin_waits: OrderedDict[str, float] = OrderedDict()  # unseen named replica -> first asked (monotonic)

    @staticmethod
    def _forwarded(pending_request: PendingRequest | None) -> Any:
        """The ingress's `Forwarded` request among the call's arguments, if any."""
        for arg in pending_request.args if pending_request is not None else []:
            if hasattr(arg, "affinity_keys"):
                return arg
        return None

    def _keys(self, pending_request: PendingRequest | None) -> list[str]:
        forwarded = self._forwarded(pending_request)
        return [] if forwarded is None else forwarded.affinity_keys

    def _queue_len(self, replica: RunningReplica) -> int | None:
        return self._replica_queue_len_cache.get(replica.replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Every rank below considers all replicas (no locality pass), so Ray Serve backs off
            # between rounds rather than retrying at once.
            pending_request.routing_context.should_backoff = True
        self.seen_replicas.update(r.replica_id.unique_id for r in candidate_replicas)
        if len(self.seen_replicas) > self.max_keys:  # bounded: forget the departed
            self.seen_replicas = {r.replica_id.unique_id for r in candidate_replicas}
        spread = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        pinned = getattr(self._forwarded(pending_request), "replica", None)
        if pinned:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == pinned:
                    self.pin_waits.pop(pinned, None)
                    return [[replica]]  # that replica alone, whatever its load
            if self._waits_for(pinned):
                return []  # asked again after a backoff, with the replica set as it is then
        by_id = {r.replica_id: r for r in candidate_replicas}
        for key in reversed(self._keys(pending_request)):
            remembered = by_id.get(self.replica_of.get(key))  # type: ignore[arg-type]
            if remembered is None:
                continue
            queue_lens = [q for q in (self._queue_len(r) for r in candidate_replicas) if q is not None]
            own = self._queue_len(remembered)
            if own is not None and (own >= remembered.max_ongoing_requests
                                    or (queue_lens and own - min(queue_lens) > self.max_imbalance)):
                break  # overloaded: spread by load
            self.num_affine += 1
            # The remembered replica first; if it refuses (full), the two by load.
            return [[remembered], spread]
        self.num_spread += 1
        return [spread]

    def _waits_for(self, pinned: str) -> bool:
        """Whether a request naming a replica this router does not have waits for it: only one it
        has never seen, and for at most PIN_WAIT_S from the first such request."""
        if pinned in self.seen_replicas:
            return False  # it left: the request goes by affinity and load
        first = self.pin_waits.setdefault(pinned, time.monotonic())
        while len(self.pin_waits) > self.max_keys:
            self.pin_waits.popitem(last=False)
        return time.monotonic() - first < PIN_WAIT_S

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        for key in self._keys(pending_request):
            self.replica_of[key] = replica_id
            self.replica_of.move_to_end(key)
        while len(self.replica_of) > self.max_keys:
            self.replica_of.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, r in self.replica_of.items() if r == replica_id]:
            del self.replica_of[key]


__all__ = ["PrefixAffinityRouter", "affinity_keys"]
