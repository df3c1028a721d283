"""`specrs serve --record-traffic DIR`: served requests kept for training heads on them.

Opt-in and off by default, because it STORES EVERY PROMPT AND OUTPUT the server handles (as token
ids) in `DIR/traffic.jsonl`, one JSON object per finished request: index, prompt_ids, response_ids,
finish_reason, spec_method and the time. The lines have the fields of the self-instruct
conversations (`specrs.train.selfinstruct`), so `specrs train-head features --conversations
DIR/traffic.jsonl` reads a recording as it is.

Invariants: nothing is written unless recording was asked for; only requests that ended normally
("stop" or "length") are recorded, with every token the target wrote for them; a failed write is
logged and never ends the request or the server; lines are appended whole under a lock.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

logger = logging.getLogger("specrs.serve")

FILE_NAME = "traffic.jsonl"


class TrafficRecorder:
    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.path = os.path.join(self.directory, FILE_NAME)
        self._lock = threading.Lock()
        self._next_index = 0
        if os.path.exists(self.path):
            with open(self.path) as f:
                self._next_index = sum(1 for line in f if line.strip())

    def on_request_finished(self, job, finish_reason: str, metrics: dict | None) -> None:
        if finish_reason not in ("stop", "length"):
            return
        with self._lock:
            row = {"index": self._next_index, "prompt_ids": list(job.request.prompt_ids),
                   "response_ids": list(job.response_ids), "finish_reason": finish_reason,
                   "spec_method": (metrics or {}).get("spec_method"), "time": time.time()}
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                self._next_index += 1
            except OSError:
                logger.exception("specrs serve: recording traffic to %s failed", self.path)
