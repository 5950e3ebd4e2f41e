"""Stop strings matched on the decoded text, across token boundaries.

`StopMatcher(stops).feed(delta) -> (text_to_emit, stopped)`: text is released only once no stop
string can still begin inside it; the longest suffix that is a prefix of some stop string is held
back. On a match, the text before the stop string is released, the stop string itself (and
anything after) is dropped — OpenAI semantics — and `stopped` is True; every later call returns
("", True). `flush()` at the end of generation releases the held-back text.
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        buf = self.held + delta
        # earliest occurrence of any stop string wins
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.held = True, ""
            return buf[:cut], True
        keep = self._partial_len(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def _partial_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out
