"""How many draft tokens a request asks for next: adaptive, so speculation that keeps failing
costs a request little (on a CPU verified rows of the output head are costly, see config.py)."""

from __future__ import annotations


class SpecWindow:
    """A per-request draft length between 1 and ``max_k``.

    A fully accepted draft grows the window by one; a partly rejected one shrinks it to one
    more than was accepted. Two drafts in a row with nothing accepted pause speculation for
    8 steps; after a pause one probe decides, and another miss doubles the pause (up to 256
    steps), so text that defeats the proposer is decoded plainly with a rare probe. Any
    accepted token ends the backoff.

    Pauses end on engine steps that are multiples of their length, so requests backing off
    together probe together: one wider step and one batched draft decode instead of many
    (a lone extra verification row in an 8-row step costs as much as four, see config.py).
    """

    MISSES_BEFORE_PAUSE = 2
    FIRST_PAUSE = 8
    MAX_PAUSE = 256
    # An engine whose recent drafts were accepted less often than this starts new requests
    # in backoff: eight requests need not each find out on their own that the draft is bad.
    POOR_ACCEPTANCE = 0.2

    def __init__(self, max_k: int, recent_acceptance: float | None = None,
                 step: int = 0) -> None:
        self.max_k = max_k
        self.k = max_k
        self._misses = 0
        self._resume_at = 0
        self._next_pause = self.FIRST_PAUSE
        if recent_acceptance is not None and recent_acceptance < self.POOR_ACCEPTANCE:
            self.k = 1
            self._misses = self.MISSES_BEFORE_PAUSE - 1
            self._pause(self.FIRST_PAUSE * 4, step)

    def want(self, step: int) -> int:
        """Draft tokens to ask for at engine step ``step`` (0: none)."""
        if self.max_k <= 0 or step < self._resume_at:
            return 0
        return self.k

    def record(self, proposed: int, accepted: int, step: int) -> None:
        """A draft of ``proposed`` tokens was verified at ``step``; ``accepted`` were kept. A
        proposer that had a cost and came back empty (a draft model below --draft-p-min)
        counts as a miss."""
        if proposed <= 0:
            return
        if accepted >= proposed:
            self.k = min(self.max_k, self.k + 1)
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self._misses = 0
            self._next_pause = self.FIRST_PAUSE
            return
        self._misses += 1
        if self._misses >= self.MISSES_BEFORE_PAUSE:
            self._misses = self.MISSES_BEFORE_PAUSE - 1  # the probe after a pause decides
            self._pause(self._next_pause, step)

    def _pause(self, length: int, step: int) -> None:
        """Pause for ``length`` to ``2 * length`` steps, ending on a multiple of ``length``."""
        self._resume_at = (step // length + 2) * length
        self._next_pause = min(length * 2, self.MAX_PAUSE)
