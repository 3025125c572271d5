"""Speculation for one engine: the proposer, every request's adaptive window, the counters.

The engine asks it, once per step and under its lock, which decoding requests want a draft and
how deep (:meth:`SpecController.wants`); runs the proposer outside the lock
(:meth:`SpecController.propose`, a draft model decodes); verifies the drafts that the scheduler
put in the batch with each request's sampler, and reports the verdicts back
(:meth:`SpecController.record`). Everything about *how much* to speculate lives here; what a
draft costs in the batch is the scheduler's, and how a draft is made is the proposer's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from justllm.core.plan import DraftTree
from justllm.core.request import Request
from justllm.core.sampling_params import SamplingParams
from justllm.errors import InvalidRequestError
from justllm.spec.proposer import DraftRequest, Proposer
from justllm.spec.window import SpecWindow

log = logging.getLogger(__name__)

RECENT_WEIGHT = 0.05  # of each verified draft in the recent acceptance rate
# Verified drafts before the recent rate decides whether new requests start in backoff: one
# rejected first draft put every request after it there.
RECENT_EVIDENCE = 8


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding counters (vLLM's spec_decode metrics): verified drafts, draft
    tokens put through the target, and how many of those were accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class SpecController:
    """``gamma``: the default most draft tokens per request and step (a request's
    ``spec_n_max`` overrides it, 0 turns speculation off for it); ``max_nodes``: the most any
    request may put in a step (a tree's nodes); ``p_min``: the default draft-model cut-off."""

    def __init__(self, proposer: Proposer, *, gamma: int, max_nodes: int, p_min: float,
                 n_vocab: int) -> None:
        self.proposer = proposer
        self._trusted = type(proposer).__module__.startswith("justllm.")  # (not a plugin's)
        self.n_vocab = n_vocab
        self.failures = 0  # proposer calls that raised or gave something unusable
        self.gamma = gamma
        self.max_nodes = max_nodes
        self.p_min = p_min
        self.stats = SpecStats()
        self._windows: dict[str, SpecWindow] = {}
        # Acceptance rate of recent drafts (an exponential average; None before any): new
        # requests start in backoff when it is poor.
        self._recent: float | None = None

    def check(self, params: SamplingParams) -> None:
        """Refuse a request's speculation fields that this server cannot honour (they were
        capped, or ignored, without a word)."""
        # (against --gamma: a tree's node count let a request ask for a tree far deeper than
        # the server drafts, whose every draft was then thrown away)
        if params.spec_n_max is not None and params.spec_n_max > self.gamma:
            raise InvalidRequestError(
                f"speculative.n_max: at most {self.gamma} draft tokens on this server (its "
                f"--gamma; got {params.spec_n_max})", param="speculative.n_max")
        if params.spec_p_min is not None and not getattr(self.proposer, "uses_p_min", False):
            raise InvalidRequestError(
                "speculative.p_min is a draft model's cut-off: this server's speculation has "
                "none (--spec draft or tree)", param="speculative.p_min")

    def admit(self, request_id: str, params: SamplingParams, step: int) -> None:
        """A new request: give it a window unless it turned speculation off."""
        n_max = self.gamma if params.spec_n_max is None else params.spec_n_max
        if n_max > 0:
            known = self._recent if self.stats.num_drafts >= RECENT_EVIDENCE else None
            self._windows[request_id] = SpecWindow(min(n_max, self.gamma), known, step)

    def release(self, request_id: str) -> None:
        self._windows.pop(request_id, None)
        try:
            self.proposer.release(request_id)
        except Exception as e:  # a plugin's proposer: the request is gone all the same
            self._failed(f"release raised {type(e).__name__}: {e}")

    def wants(self, decoding: Iterable[Request], step: int) -> list[DraftRequest]:
        """The requests about to decode whose window is open at ``step``, with their depth."""
        out = []
        for req in decoding:
            window = self._windows.get(req.request_id)
            k = window.want(step) if window is not None else 0
            if k and req.params.max_tokens is not None:
                # a step makes the accepted drafts and one token more: drafts past the last
                # token the request may make would be drafted and verified for nothing
                k = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
            if k > 0:
                p = req.params
                out.append(DraftRequest(
                    req.request_id, req.prompt_token_ids + req.output_token_ids, k, p,
                    self.p_min if p.spec_p_min is None else p.spec_p_min,
                    k_max=window.max_k))  # type: ignore[union-attr]
        return out

    def propose(self, wants: list[DraftRequest]) -> dict[str, DraftTree]:
        """Run the proposer (outside the engine lock: a draft model decodes). A plugin's
        proposer may fail: if it raises, or gives something that is not a draft for a request
        that asked (a ``DraftTree`` of ids in the vocabulary, parents before children, no
        deeper than the request may go), that step goes without those drafts: a wrong
        proposer costs speed, never a request (the first failure and every 1000th after it
        are logged)."""
        if not wants:
            return {}
        try:
            drafts = self.proposer.propose(wants)
        except Exception as e:
            self._failed(f"raised {type(e).__name__}: {e}")
            return {}
        if not isinstance(drafts, dict):
            self._failed(f"gave a {type(drafts).__name__}, not a dict of drafts")
            return {}
        asked = {w.request_id: w for w in wants}
        good = {rid: d for rid, d in drafts.items()
                if rid in asked and self._sound(d, max(asked[rid].k, asked[rid].k_max,
                                                       self.max_nodes))}
        if len(good) < len(drafts):
            self._failed(f"gave {len(drafts) - len(good)} draft(s) that are not DraftTrees "
                         f"of token ids in [0, {self.n_vocab}) for requests that asked")
        return good

    def _sound(self, draft: object, most: int) -> bool:
        if not isinstance(draft, DraftTree) or not 0 < len(draft.tokens) <= most:
            return False
        if len(draft.parents) != len(draft.tokens) or not all(
                isinstance(p, int) and -1 <= p < i for i, p in enumerate(draft.parents)):
            return False
        if draft.q is not None and not self._sound_q(draft.q, len(draft.tokens)):
            return False
        return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.n_vocab
                   for t in draft.tokens)

    def _sound_q(self, q: object, rows: int) -> bool:
        """Probability rows a verification can use: one per node, each over the vocabulary,
        finite and not negative (a narrow row was an IndexError, a NaN one drew a token past
        the vocabulary: either failed every request of the step). The values are read only
        for a plugin's proposer: justllm's own gives softmax rows, and reading rows as wide
        as the vocabulary at every step would cost a sampled draft much of its gain."""
        if isinstance(q, np.ndarray) and self._trusted:
            return q.shape == (rows, self.n_vocab)
        try:
            a = np.asarray(q, dtype=np.float64)
        except (TypeError, ValueError):
            return False
        return a.shape == (rows, self.n_vocab) and bool(np.isfinite(a).all() and (a >= 0).all())

    def _failed(self, why: str) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 1000 == 0:
            log.warning("speculation: the proposer %s (%d failure(s) so far); those steps "
                        "decode without its drafts", why, self.failures)

    def record_misses(self, wants: list[DraftRequest], drafts: dict[str, DraftTree],
                      step: int) -> None:
        """A costly proposer that came back empty for a request counts as a miss for it."""
        if not self.proposer.costly:
            return
        for w in wants:
            window = self._windows.get(w.request_id)
            if w.request_id not in drafts and window is not None:
                window.record(1, 0, step)

    def record(self, request_id: str, draft: DraftTree, accepted: int, step: int) -> None:
        """``accepted`` nodes of ``draft`` (its deepest path) were kept at ``step``."""
        proposed = max(draft.depths)
        window = self._windows.get(request_id)
        if window is not None:
            window.record(proposed, accepted, step)
        s = self.stats
        self.stats = SpecStats(s.num_drafts + 1, s.num_draft_tokens + len(draft),
                               s.num_accepted_tokens + accepted)
        rate = accepted / proposed
        prev = self._recent
        # The mean of the first drafts, then an exponential average (its weight would leave
        # the first draft's rate most of the average for dozens of drafts)
        weight = max(RECENT_WEIGHT, 1 / self.stats.num_drafts)
        self._recent = rate if prev is None else prev + weight * (rate - prev)

    def close(self) -> None:
        self.proposer.close()
