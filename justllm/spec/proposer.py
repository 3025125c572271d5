"""Draft proposers behind one interface.

``NgramProposer`` is prompt lookup (no extra model); ``DraftModelProposer`` (in
``draft_model.py``) runs a small GGUF. The engine asks for drafts once per step, for every
request about to decode, on its own thread (the only one that calls llama.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from justllm.core.plan import DraftTree
from justllm.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    """One request that wants a draft this step."""

    request_id: str
    tokens: list[int]  # prompt + output so far; the draft continues after the last one
    k: int  # this many tokens deep, as the request's window asks
    params: SamplingParams
    p_min: float = 0.0  # a model proposer stops where its top candidate is less likely
    k_max: int = 0  # a free proposer may go this deep (the scheduler uses the extra tokens
    #                 only to fill output rows the step pays for anyway); 0: k


class Proposer(Protocol):
    # True when proposing costs compute even if no draft comes back (a draft model decodes
    # to find out it is unsure): the engine then counts an empty draft as a miss.
    costly: bool

    def propose(self, wants: list[DraftRequest]) -> dict[str, DraftTree]:
        """Drafts for some of ``wants`` (a request may get none)."""
        ...

    def release(self, request_id: str) -> None:
        """The request is gone; forget its state. Safe to call from any thread."""
        ...

    def close(self) -> None: ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last ``n`` tokens (longest ``n``
    first, down to ``min_n``) and propose the tokens that followed it. Repetitive text — code
    being edited, a document quoted back — makes these drafts right most of the time."""

    costly = False

    # A 1- or 2-token match is weak evidence: on a CPU a failed draft costs a step 2.5x a
    # plain one (the output head per verified row), so only 3- and 4-token matches propose
    # (measured, repetitive text, 1 stream: 1 <= n <= 3 ran at 1.03x, 3 <= n <= 4 at 1.5x).
    def __init__(self, max_n: int = 4, min_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, wants: list[DraftRequest]) -> dict[str, DraftTree]:
        out = {}
        for w in wants:
            draft = self.lookup(w.tokens, max(w.k, w.k_max))
            if draft:
                out[w.request_id] = DraftTree.chain(draft, wanted=w.k)
        return out

    def release(self, request_id: str) -> None:
        pass  # stateless

    def close(self) -> None:
        pass

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the tail."""
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
