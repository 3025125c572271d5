"""How many draft tokens a request asks for next: adaptive, so speculation that keeps failing
costs a request little (on a CPU every verified row costs ~4 ms of the output head)."""

from __future__ import annotations


class SpecWindow:
    """A per-request draft length between 1 and ``max_k``.

    A fully accepted draft grows the window by one; a partly rejected one shrinks it to one
    more than was accepted. Three drafts in a row with nothing accepted pause speculation for
    a number of steps that doubles each time (up to 64), so text that defeats the proposer is
    decoded plainly, with a probe now and then.
    """

    MAX_PAUSE = 64
    MISSES_BEFORE_PAUSE = 3

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.k = max_k
        self._misses = 0
        self._pause = 0
        self._next_pause = 1

    def want(self) -> int:
        """Draft tokens to ask for this step (0: none)."""
        if self.max_k <= 0:
            return 0
        if self._pause:
            self._pause -= 1
            return 0
        return self.k

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        if accepted >= proposed:
            self.k = min(self.max_k, self.k + 1)
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self._misses = 0
            self._next_pause = 1
            return
        self._misses += 1
        if self._misses >= self.MISSES_BEFORE_PAUSE:
            self._misses = 0
            self._pause = self._next_pause
            self._next_pause = min(self._next_pause * 2, self.MAX_PAUSE)
