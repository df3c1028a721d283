"""OpenAI's `stop` strings over streamed text.

Invariant: no emitted text ever contains a stop string or a piece of one: up to
(longest stop - 1) characters are held back until the next text shows they start no stop string,
and the text ends right before the first stop string found.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # everything generated so far, cut at a stop string once found
        self.num_emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def feed(self, new_text: str) -> str:
        """The text that is safe to emit after `new_text` arrived; sets `stopped` at a stop string."""
        if self.stopped:
            return ""
        self.text += new_text
        if not self.stops:
            return self._emit_to(len(self.text))
        # A stop string may start in the held-back tail of what came before.
        start = max(self.num_emitted - self.hold, 0)
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True
            return self._emit_to(len(self.text))
        return self._emit_to(max(len(self.text) - self.hold, self.num_emitted))

    def flush(self) -> str:
        """The held-back rest, once generation has ended without a stop string."""
        return self._emit_to(len(self.text))

    def _emit_to(self, end: int) -> str:
        out = self.text[self.num_emitted:end]
        self.num_emitted = end
        return out
