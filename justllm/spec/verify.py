"""Lossless verification of draft tokens against the target model's rows of logits.

Greedy: keep drafts while they equal the target's argmax, then add the target's own token
(the correction, or the bonus after a full match). Sampling: the standard rule — accept draft
``x`` with probability ``min(1, p(x)/q(x))``, on rejection sample from ``norm(max(0, p - q))`` —
so the output distribution is exactly the target's. For a deterministic proposer (n-gram) ``q``
is a point mass and the rule becomes "accept with probability p(x)", residual = p without x.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # what to append: accepted drafts, then one token from the target
    accepted: int  # how many drafts were kept


def verify_greedy(target_rows: np.ndarray, draft: list[int]) -> Verdict:
    """``target_rows``: ``len(draft) + 1`` rows of logits (row i predicts draft[i])."""
    out: list[int] = []
    for i, d in enumerate(draft):
        t = int(np.argmax(target_rows[i]))
        out.append(t)
        if t != d:
            return Verdict(out, i)
    out.append(int(np.argmax(target_rows[len(draft)])))
    return Verdict(out, len(draft))


def verify_sampled(target_probs: np.ndarray, draft: list[int], draft_probs: np.ndarray | None,
                   rng: np.random.Generator) -> Verdict:
    """Rejection sampling. ``target_probs``: ``len(draft) + 1`` rows of the target's sampling
    distribution (after temperature/top-k/top-p); ``draft_probs``: the proposer's rows, or None
    for a deterministic proposer."""
    out: list[int] = []
    for i, d in enumerate(draft):
        p = target_probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i][d])
        if q_d > 0 and rng.random() < min(1.0, float(p[d]) / q_d):
            out.append(d)
            continue
        if draft_probs is None:
            residual = np.array(p, dtype=np.float64)
            residual[d] = 0.0
        else:
            residual = np.maximum(np.asarray(p, dtype=np.float64) - draft_probs[i], 0.0)
        total = residual.sum()
        if total <= 0:  # p == q: any draw from p is right
            residual, total = np.asarray(p, dtype=np.float64), float(np.sum(p))
        out.append(int(np.searchsorted(np.cumsum(residual), rng.random() * total, side="right")))
        return Verdict(out, i)
    p = np.asarray(target_probs[len(draft)], dtype=np.float64)
    out.append(int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right")))
    return Verdict(out, len(draft))
