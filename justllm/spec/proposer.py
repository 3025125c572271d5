"""Draft proposers behind one interface; ``NgramProposer`` is prompt lookup (no extra model)."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Proposer(Protocol):
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (prompt + output so far)."""
        ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last ``n`` tokens (longest ``n``
    first, down to ``min_n``) and propose the tokens that followed it. Repetitive text — code
    being edited, a document quoted back — makes these drafts right most of the time."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            tail = arr[-n:]
            # windows of length n over everything but the tail itself
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest match's continuation
                draft = tokens[start:start + k]
                if draft:
                    return draft
        return []
