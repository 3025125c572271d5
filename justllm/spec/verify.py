"""Lossless verification of draft tokens against the target model's rows of logits.

One path for every method and sampling rule: :func:`walk_draft` descends a chain or tree with
the request's own sampler deciding each row (the engine's ``_verify``). Greedy keeps drafts
while they equal the target's argmax, then adds the target's own token (the correction, or the
bonus after a full match). Sampling uses the standard rule (:func:`accept_or_resample`): accept
draft ``x`` with probability ``min(1, p(x)/q(x))``, on rejection sample from
``norm(max(0, p - q))``, so the output distribution is exactly the target's. For a
deterministic proposer (n-gram) ``q`` is a point mass and the rule becomes "accept with
probability p(x)", residual = p without x.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from justllm.core.plan import DraftTree


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # what to append: accepted drafts, then one token from the target
    accepted: int  # how many drafts were kept
    path: tuple[int, ...] = ()  # the kept draft nodes, root's child first


def walk_draft(draft: DraftTree, step: Callable[[int, tuple[int, ...]], tuple[int, bool]]
               ) -> Verdict:
    """Verify a draft chain or tree: from the root, take the target's token at the current
    row and descend into the child holding that token; stop at the first token no child holds
    (a correction, or the bonus token after a leaf).

    ``step(row, children)`` returns the target's token at ``row`` (0: the root, ``i + 1``: node
    ``i``) given the draft nodes below it, and whether generation stops after that token.
    Whatever the target's rule (argmax, a sample, rejection sampling against ``q``), each kept
    token is exactly the one the target would have produced alone: lossless.
    """
    out: list[int] = []
    path: list[int] = []
    row = 0
    while True:
        kids = draft.children[row]
        token, stop = step(row, kids)
        out.append(token)
        nxt = next((k for k in kids if draft.tokens[k] == token), None)
        if nxt is not None:
            path.append(nxt)
        if stop or nxt is None:
            return Verdict(out, len(path), tuple(path))
        row = nxt + 1


def accept_or_resample(p: np.ndarray, d: int, q: np.ndarray | None,
                       rng: np.random.Generator) -> int:
    """One row of rejection sampling: ``d`` if accepted, else a draw from the residual.
    ``p``: the target's distribution; ``q``: the proposer's, or None for a point mass."""
    q_d = 1.0 if q is None else float(q[d])
    if q_d > 0 and rng.random() < min(1.0, float(p[d]) / q_d):
        return d
    if q is None:
        residual = np.array(p, dtype=np.float64)
        residual[d] = 0.0
    else:
        residual = np.maximum(np.asarray(p, dtype=np.float64) - q, 0.0)
    total = residual.sum()
    if total <= 0:  # p == q: any draw from p is right
        residual, total = np.asarray(p, dtype=np.float64), float(np.sum(p))
    # (the cumulative sum's last entry can fall a rounding short of ``total``: a draw past it
    # would be the token after the vocabulary's last)
    return min(int(np.searchsorted(np.cumsum(residual), rng.random() * total, side="right")),
               len(residual) - 1)
