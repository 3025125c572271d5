"""Token sampling over one logits row, in numpy.

Greedy is ``np.argmax`` (docs/llama-cpp-facts.md: ~22 µs on the 262k vocabulary, ~15x faster than a llama.cpp
sampler chain). Sampled decoding applies penalties, temperature, top-k, min-p, top-p,
then draws from the request's own generator, so a seed reproduces a request alone.

Full-vocabulary passes are what a sampled token costs (one ``exp`` over 262k floats is ~0.5
ms here), so a draw makes two cheap ones -- the row's maximum, and a compare that keeps the
*candidates*, the tokens within ``_CUT`` nats (after temperature) of the best -- and does
everything else on those few thousand. Nothing is approximated: every other token weighs less
than ``e**-_CUT`` of the best (together at most their count times that), and the sampler needs
their exact weight only when that bound could change the answer (``_draw``). Without min-p a
draw first tries a smaller set still (:func:`_near`): the tokens within 12 nats, the rest
bounded from two counts, which decides 99 pure-temperature draws in 100 and about 99 top-p
draws in 100 on the demo model; the others go on to the candidates within the cut with the
same uniforms, then to the whole row, so the token is the exact nucleus's for those uniforms
either way. Fewer candidates (a shorter cut) cost less to find, but leave more draws
undecided: 18 nats was the fastest on the demo model's rows (16 to 20 tried). ``top_k`` alone
never looks past the k best (:func:`top_candidates`).

A top-p draw is made in two steps so that a bound on the nucleus's weight decides it
(:class:`_NucleusDraw`): the nucleus's most likely tokens that every cut the first bound
allows keeps (its *head*) are drawn with the probability of their share of the nucleus, and
the token among them or among the rest by weight. Only a first uniform that falls within the
bound's share of the end of [0, 1) needs the exact weight (one draw in a hundred or so on the
demo model's rows). A draw in one step (an inverse CDF) needed it whenever the uniform picked
different tokens from the nuclei the bound allowed: one draw in twenty at temperature 0.8 and
top-p 0.95, one in eight at 1.0 and 0.9, each then ~0.8 ms on the engine thread.

Candidate ids are kept in ascending order, and a nucleus is walked from its most likely token
down (ties by id), so a draw depends on the distribution alone, not on how a partition
happened to order its output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from justllm.core.sampling_params import SamplingParams
from justllm.core.thinking_budget import ThinkingBudget
from justllm.spec.verify import accept_or_resample

_NUCLEUS_LEVELS = (np.float32(1e-2), np.float32(1e-4))
# Candidates: tokens within _CUT nats of the best after temperature. Each other token weighs at
# most _CUT_WEIGHT of the best (the 1.001 covers float32 rounding of the scaled logit).
_CUT = 18.0
_CUT_WEIGHT = math.exp(-_CUT) * 1.001
# Pure temperature's inner regions (``_draw_tempered``), in nats, as fractions of the cut so a
# test that shortens the cut keeps them nested: 12 and 15 were the fastest on the demo model.
_NEAR_SHARE, _MID_SHARE = 2 / 3, 5 / 6
_CDF_BLOCK = 4096


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class PreparedRow:
    """A row after :meth:`RequestSampler.prepare`: the raw row (logprobs are the model's
    own), the row the draw reads (``x``: after penalties, bias, ``min_tokens``' mask; the raw
    row itself without them), a greedy row's token, a sampled row's first passes, and the
    logprobs' normaliser and most likely tokens when the request asks for logprobs."""

    logits: np.ndarray
    x: np.ndarray
    token: int | None = None
    scan: Scan | None = None
    table: tuple[float, tuple[tuple[int, float], ...]] | None = None


class Constraint(Protocol):
    """A token mask with state, such as a grammar (``GrammarMatcher``). ``active``: whether
    it holds the answer now (a lazy grammar only once its trigger came)."""

    @property
    def active(self) -> bool: ...
    def mask(self, logits: np.ndarray) -> np.ndarray: ...
    def allows(self, token: int) -> bool: ...
    def allowed_argmax(self, logits: np.ndarray) -> int: ...
    def accept(self, token: int) -> None: ...


@dataclass(frozen=True)
class InfillVocab:
    """What the infill step (:func:`infill_keep`) reads of the vocabulary: a token's text
    (control tokens as nothing), whether it ends generation, and the token to end with."""

    piece: Callable[[int], bytes]
    is_eog: Callable[[int], bool]
    end: int


class RequestSampler:
    """Sampling state of one request: its random generator, parameters and constraint."""

    def __init__(self, params: SamplingParams, seed: int,
                 constraint: Constraint | None = None,
                 end_tokens: np.ndarray | None = None,
                 infill: InfillVocab | None = None,
                 budget: tuple[ThinkingBudget, Callable[[int], bytes]] | None = None) -> None:
        """``end_tokens``: what ``min_tokens`` masks out until that many tokens are out (the
        end-of-generation tokens and the request's stop tokens); ``infill``: the vocabulary,
        for a chain with the infill step; ``budget``: the thinking budget, and a token's text
        (what it reads)."""
        assert infill is not None or "infill" not in (params.samplers or ())
        self._infill = infill
        self.budget = budget[0] if budget else None
        self._piece = budget[1] if budget else None
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.constraint = constraint
        self._end_tokens = end_tokens
        self._bias: tuple[np.ndarray, np.ndarray] | None = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self._bias = (np.asarray(ids, dtype=np.int64), np.asarray(values, dtype=np.float32))

    def sample(self, logits: np.ndarray, prompt_ids: list[int], output_ids: list[int],
               against: tuple[int, np.ndarray] | None = None) -> SampledToken:
        """The request's next token. ``against``: (draft token, the proposer's probability
        row) when the proposer *sampled* that token; a sampled request then accepts it with
        probability min(1, p/q), else draws from the residual (rejection sampling: the result
        is distributed exactly as without ``against``)."""
        return self.draw(self.prepare(logits, prompt_ids, output_ids, scan=against is None),
                         against)

    def prepare(self, logits: np.ndarray, prompt_ids: list[int], output_ids: list[int],
                scan: bool = True) -> PreparedRow:
        """The passes over the whole row that need neither the generator nor the grammar:
        penalties, bias and ``min_tokens``' mask, a greedy row's argmax, a sampled row's first
        passes (:func:`_scan`), the logprobs' normaliser. Any thread may run them, in any
        order (engine/row_sampling.py); :meth:`draw` does the rest."""
        p = self.params
        x = logits
        if p.has_penalties:
            x = apply_penalties(logits, p, prompt_ids, output_ids)
        if self._bias is not None:
            if x is logits:
                x = np.array(logits, dtype=np.float32)  # our own copy: the row is the batch's
            np.add.at(x, self._bias[0], self._bias[1])
        if self._end_tokens is not None and len(output_ids) < p.min_tokens:
            if x is logits:
                x = np.array(logits, dtype=np.float32)
            x[self._end_tokens] = -np.inf
        unconstrained = self.constraint is None
        return PreparedRow(
            logits, x,
            token=int(np.argmax(x)) if p.greedy and unconstrained else None,
            scan=_scan(x, p) if scan and _scans(p, x.size) else None,
            table=None if p.logprobs is None else logprob_table(logits, p.logprobs))

    def draw(self, row: PreparedRow, against: tuple[int, np.ndarray] | None = None
             ) -> SampledToken:
        """The token of a prepared row (:meth:`prepare`), and its logprobs if asked."""
        p = self.params
        x = row.x
        c = self.constraint
        forced = self.budget.forced() if self.budget is not None else None
        if forced is not None:  # the budget closes the thinking (never with a grammar)
            token = forced
        elif row.token is not None:
            token = row.token
        elif p.greedy:  # (without a grammar, prepare took the argmax)
            assert c is not None
            token = c.allowed_argmax(x)
        elif c is not None and against is None:
            # Draw first and mask only if the grammar refuses the draw (llama.cpp's order):
            # masking is a pass of the grammar over all 262k tokens. Without truncation this is
            # exactly the masked distribution: P(a) = p(a) + (1 - p(A)) p(a) / p(A) = p(a)/p(A).
            token = self._draw(x, row.scan)
            if not c.allows(token):
                token = self._draw(c.mask(x))
        elif against is not None:
            token = self._draw_against(x if c is None else c.mask(x), *against)
        else:
            token = self._draw(x, row.scan)
        if c is not None:
            c.accept(token)
        self.accepted(token)
        if row.table is None:
            return SampledToken(token)
        lse, top = row.table
        return SampledToken(token, float(row.logits[token]) - lse, top)

    def draw_candidates(self, ids: np.ndarray, probs: np.ndarray, bound: float) -> int | None:
        """A token drawn from candidates that carry the row's own probabilities under its
        softmax at this request's temperature (engine/backend.py ``_CandidatesSampler``: no
        token left out weighs more than ``bound``), for a request with top-k (at most the
        candidates) or top-p, perhaps min-p, in OpenAI's order and without penalties, bias or
        a grammar (engine/graph_sampling.py). Exactly the draw from the whole row whenever
        every token the cuts keep weighs more than the bound; None (and no uniform used)
        otherwise: the row is needed."""
        p = self.params
        order = np.argsort(-probs, kind="stable")
        w = probs[order].astype(np.float64)
        known = False  # whether what the cuts keep so far lies among the candidates
        total = 1.0  # the mass kept so far (at first the whole row's: its softmax)
        if p.top_k > 0:  # the k best, if the k-th beats every token left out
            if p.top_k > w.size or w[p.top_k - 1] <= bound:
                return None
            order, w, known = order[:p.top_k], w[:p.top_k], True
            total = float(w.sum())
        if p.min_p > 0.0:  # what weighs at least min_p times the best
            floor = p.min_p * float(w[0])
            if not known and floor <= bound:
                return None
            kept = int(np.searchsorted(-w, -floor, side="right"))
            order, w, known = order[:kept], w[:kept], True
            total = float(w.sum())
        if p.top_p < 1.0:  # the smallest most likely set holding top_p of the mass kept
            last = int(np.searchsorted(np.cumsum(w), p.top_p * total))
            if known:
                last = min(last, w.size - 1)
            elif last >= w.size or w[last] <= bound:
                return None
            order, w = order[:last + 1], w[:last + 1]
        elif not known:  # (pure temperature: the tail may be drawn; the graph draws those)
            return None
        return int(ids[order[inverse_cdf(w, self.rng.random())]])

    def accepted(self, token: int) -> None:
        """``token`` is the request's next (drawn, or handed over): the budget counts it."""
        if self.budget is not None:
            assert self._piece is not None
            self.budget.accept(token, self._piece(token))

    def _draw_against(self, x: np.ndarray, draft_token: int, q_row: np.ndarray) -> int:
        ids, w = self._distribution(x)
        dense = np.zeros(x.size, dtype=np.float64)
        dense[slice(None) if ids is None else ids] = w / w.sum(dtype=np.float64)
        return accept_or_resample(dense, draft_token, q_row, self.rng)

    def _draw(self, x: np.ndarray, scan: Scan | None = None) -> int:
        """One token from the candidates (module docstring); the whole row only when the
        weight left out could change the answer. ``scan``: ``x``'s first passes, when
        :meth:`prepare` made them. Every branch that does not depend on the draw
        may use any exact method; the branches that do keep one order of the tokens, so the
        result is distributed exactly as the full softmax."""
        p = self.params
        if not _scans(p, x.size):
            return self._draw_full(x)
        if scan is None:
            scan = _scan(x, p)
        m = scan.best
        nucleus = _NucleusDraw(self.rng)
        if scan.near is not None:  # first from the near tokens alone (_near)
            near, w_near, bound = _near(x, scan)
            if p.top_p >= 1.0:
                return self._draw_tempered(x, m, near, w_near, bound)
            found = _nucleus(w_near, p.top_p, bound)
            token = nucleus.settle(found) if found is not None else None
            if token is not None:
                return int(near[token])
            # Undecided: the candidates within _CUT decide, for the same uniforms.
        # Min-p keeps the weights of at least min_p (the best is 1): none lies further than
        # ln(1/min_p) nats from the best, so with min-p the candidates need go no further (the
        # margin covers float32 rounding; the min-p test below decides).
        cut = min(_CUT, -math.log(p.min_p) * 1.001 + 1e-3) if p.min_p else _CUT
        ids = np.flatnonzero(x >= np.float32(m - p.temperature * cut))
        # The weight of everything else: a bound (exactly 0 once min-p has cut, since it keeps
        # candidates only).
        rest = 0.0 if p.min_p else (x.size - ids.size) * _CUT_WEIGHT
        w = _weights(x[ids], m, p.temperature)
        if p.min_p > 0.0:
            keep = np.flatnonzero(w >= np.float32(p.min_p))  # p >= min_p * p_max
            ids, w = ids[keep], w[keep]
        if p.top_p < 1.0:
            found = _nucleus(w, p.top_p, rest)
            token = nucleus.settle(found) if found is not None else None
            if token is None and rest:  # the left-out weight decides the draw: weigh it
                rest = max(_total(x, m, p.temperature) - float(w.sum(dtype=np.float64)), 0.0)
                found = _nucleus(w, p.top_p, rest, exact=True)
                token = nucleus.settle(found) if found is not None else None  # exact: decided
            if token is None:  # the nucleus reaches past the candidates: the whole row's
                found = _nucleus(_weights(x, m, p.temperature), p.top_p, 0.0, exact=True)
                assert found is not None  # with nothing left out, the nucleus is within x
                token = nucleus.settle(found)
                assert token is not None  # an exact cut decides
                return token
            return int(ids[token])
        return int(ids[inverse_cdf(w, self.rng.random())])

    def _draw_tempered(self, x: np.ndarray, m: float, near: np.ndarray, w_near: np.ndarray,
                       bound: float) -> int:
        """Pure temperature (no top-p, min-p or top-k), in nested regions: the near tokens
        (:func:`_near`), the candidates within ``_CUT``, and the whole row. A uniform ``u``
        says where ``u`` times the row's total weight falls, so which region the token comes
        from; a fresh uniform then draws it within that region (less the inner one), by weight
        -- exactly the whole row's distribution. The total is only bounded at first (the near
        weight plus ``bound``); that decides about 99 draws in 100 on the demo model. Only
        undecided draws list the ``_CUT`` candidates, and then, rarely, weigh the whole row."""
        t = self.params.temperature
        near_cut = _CUT * _NEAR_SHARE
        near_weight = float(w_near.sum(dtype=np.float64))
        u = self.rng.random()
        if u * (near_weight + bound) < near_weight:
            return int(near[inverse_cdf(w_near, self.rng.random())])
        ids = np.flatnonzero(x >= np.float32(m - t * _CUT))
        band = ids[x[ids] < np.float32(m - t * near_cut)]  # within _CUT, beyond near_cut
        w_band = _weights(x[band], m, t)
        inside = near_weight + float(w_band.sum(dtype=np.float64))
        # The total lies between ``inside`` and ``high``; ``u`` times it falls in the near
        # region below near_weight, in the band below inside, beyond the candidates above.
        high = inside + (x.size - ids.size) * _CUT_WEIGHT
        if u * high < near_weight:
            in_band = False
        elif near_weight <= u * inside and u * high < inside:
            in_band = True
        else:  # the bound cannot tell: weigh the whole row
            full = _weights(x, m, t)
            drawn = u * float(full.sum(dtype=np.float64))
            if drawn >= inside and ids.size < x.size:
                full[ids] = 0.0
                return inverse_cdf(full, self.rng.random())
            in_band = drawn >= near_weight and band.size > 0
        if in_band:
            return int(band[inverse_cdf(w_band, self.rng.random())])
        return int(near[inverse_cdf(w_near, self.rng.random())])

    def _draw_full(self, x: np.ndarray, u: float | None = None) -> int:
        ids, w = self._distribution(x)
        choice = inverse_cdf(w, self.rng.random() if u is None else u)
        return int(choice if ids is None else ids[choice])

    def _distribution(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """The sampling distribution over ``x``: (token ids or None for all, *unnormalised*
        weights; the largest is 1)."""
        p = self.params
        if p.samplers is not None:
            return self._chain(x, p.samplers)
        ids: np.ndarray | None = None
        if p.top_k and p.top_k < x.size:
            ids = top_candidates(x, p.top_k)
            x = x[ids]
        w = _weights(x, float(x.max()), p.temperature)
        if p.min_p > 0.0:
            keep = np.flatnonzero(w >= np.float32(p.min_p))  # p >= min_p * p_max
            ids = keep if ids is None else ids[keep]
            w = w[keep]
        if p.top_p < 1.0:
            found = _nucleus(w, p.top_p, 0.0, exact=True)
            assert found is not None  # with nothing left out, the nucleus is within w
            keep = found.members(found.first)
            ids = keep if ids is None else ids[keep]
            w = w[keep]
        return ids, w

    def _chain(self, x: np.ndarray, steps: tuple[str, ...]
               ) -> tuple[np.ndarray | None, np.ndarray]:
        """:meth:`_distribution` in llama.cpp's way (llama-server's ``samplers``): the steps in
        their order, each cut made on the distribution as the steps before it left it -- a
        temperature scales the logits of what is left (two scale twice), a cut keeps what it
        keeps of them. With the default order (temperature last) top-p and min-p see the
        untempered distribution."""
        p = self.params
        ids: np.ndarray | None = None
        scale = 1.0  # the product of 1/T of the temperature steps so far
        for step in steps:
            keep: np.ndarray | None = None
            if step == "temperature":
                scale /= p.temperature
            elif step == "top_k" and 0 < p.top_k < x.size:
                keep = top_candidates(x, p.top_k)
            elif step == "min_p" and p.min_p > 0.0:  # (x - best) * scale >= ln(min_p)
                keep = np.flatnonzero(x >= np.float32(float(x.max()) + math.log(p.min_p) / scale))
            elif step == "top_p" and p.top_p < 1.0:
                found = _nucleus(_weights(x, float(x.max()), 1.0 / scale), p.top_p, 0.0,
                                 exact=True)
                assert found is not None  # with nothing left out, the nucleus is within x
                keep = found.members(found.first)
            elif step == "infill":
                assert self._infill is not None
                keep = infill_keep(x * np.float32(scale),
                                   np.arange(x.size) if ids is None else ids, self._infill)
                if keep is None:  # nothing but the end is likely
                    return np.array([self._infill.end]), np.ones(1, dtype=np.float32)
            if keep is not None:
                ids = keep if ids is None else ids[keep]
                x = x[keep]
        return ids, _weights(x, float(x.max()), 1.0 / scale)


# What a text token needs (its own weight and the weight of the tokens merged into it) to stay
# a candidate of the infill step; llama.cpp's threshold.
_INFILL_KEEP = 0.2


def infill_keep(z: np.ndarray, ids: np.ndarray, vocab: InfillVocab) -> np.ndarray | None:
    """llama.cpp's infill sampler (for fill-in-the-middle, after top-k): which of the
    candidates (tempered logits ``z`` of tokens ``ids``) stay, as positions in ``z``, or None
    when only the end is left. If the end-of-generation tokens are likely enough (three times
    their probability times the candidates outweighs the text's), only they stay. Else a
    token whose text begins another's takes the other's probability, or gives its own if the
    other is likelier (in order of probability, as llama.cpp merges them), text tokens left
    under 0.2 go, then (renormalised) those under 1 / (the text tokens left + 1). The draw
    then weighs what stays by its own logit, as llama.cpp's does."""
    order = np.lexsort((ids, -z))  # most probable first (ties by id)
    p = np.exp(z[order].astype(np.float64) - float(z.max()))
    p /= p.sum()
    eog = [vocab.is_eog(int(ids[i])) for i in order]
    p_eog = float(sum(q for q, e in zip(p, eog) if e))
    if 3.0 * p_eog * len(order) > float(p.sum()) - p_eog:
        return np.sort(order[np.flatnonzero(eog)])
    pieces = [vocab.piece(int(ids[i])) for i in order]
    gone = [False] * len(order)
    for a, head in enumerate(pieces):
        if not head:
            continue
        for b, other in enumerate(pieces):
            if gone[a]:
                break
            if a == b or gone[b] or not other.startswith(head):
                continue
            dst, src = (b, a) if p[b] > p[a] else (a, b)
            p[dst] += p[src]
            p[src] = 0.0
            gone[src] = True
    kept = [k for k in range(len(order)) if not gone[k] and (eog[k] or p[k] >= _INFILL_KEEP)]
    n_text = sum(not eog[k] for k in kept)
    if n_text == 0:
        return None
    # then, renormalised, text tokens under 1 / (their number + 1) go too
    total = float(sum(p[k] for k in kept))
    kept = [k for k in kept if eog[k] or p[k] / total >= 1.0 / (n_text + 1)]
    return np.sort(order[kept])


def top_candidates(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of ``x``'s ``k`` largest values, ascending.

    Block maxima bound the k-th largest value from below: if ``k`` blocks have a maximum of at
    least ``t``, at least ``k`` values are ``>= t``, so every one of the ``k`` largest is too.
    One pass for the maxima and one compare then leave a few hundred candidates to partition
    instead of the whole row.
    """
    n = x.size
    block = 1 << max(4, int(n // (4 * k)).bit_length() - 1)  # >= 4k blocks, a power of two
    full = n - n % block
    if full // block <= k:
        ids = np.argpartition(-x, k - 1)[:k]
    else:
        maxima = x[:full].reshape(-1, block).max(axis=1)
        bound = np.partition(maxima, maxima.size - k)[maxima.size - k]
        cand = np.flatnonzero(x >= bound)  # tail values past ``full`` are checked too
        ids = cand if cand.size <= k else cand[np.argpartition(-x[cand], k - 1)[:k]]
    ids.sort()
    return ids


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The index where the cumulative mass passes ``u`` (in [0, 1)) of the total, in two
    levels (blocks, then within one block) so a 262k-wide row needs no full float64 cumsum."""
    n = probs.size
    if n <= _CDF_BLOCK * 2:
        cdf = np.cumsum(probs, dtype=np.float64)
        return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), n - 1)
    full = n - n % _CDF_BLOCK
    block_sums = probs[:full].reshape(-1, _CDF_BLOCK).sum(axis=1, dtype=np.float64)
    if full < n:
        block_sums = np.append(block_sums, probs[full:].sum(dtype=np.float64))
    outer = np.cumsum(block_sums)
    target = u * outer[-1]
    b = min(int(np.searchsorted(outer, target, side="right")), outer.size - 1)
    start = b * _CDF_BLOCK
    inner = np.cumsum(probs[start:start + _CDF_BLOCK], dtype=np.float64)
    rest = target - (outer[b - 1] if b else 0.0)
    return min(start + int(np.searchsorted(inner, rest, side="right")), n - 1)


def _weights(x: np.ndarray, m: float, temperature: float) -> np.ndarray:
    """exp((x - m) / T) in a float32 buffer of our own (the best weight is 1 when m is x's
    maximum)."""
    w = np.subtract(x, np.float32(m), dtype=np.float32)
    w *= np.float32(1.0 / temperature)
    np.exp(w, out=w)
    return w


@dataclass(frozen=True)
class Scan:
    """A sampled row's first passes over the whole vocabulary (:func:`_scan`): its best logit
    and, without min-p, the near tokens (within two thirds of the cut, 12 nats) with the counts
    within five sixths of it (15 nats) and within the cut (18)."""

    best: float
    temperature: float
    near: np.ndarray | None = None
    near_logits: np.ndarray | None = None  # x[near], read while the row is in the core's cache
    n_mid: int = 0
    n_cut: int = 0


def _scans(p: SamplingParams, size: int) -> bool:
    """Whether a sampled draw with ``p`` starts from :func:`_scan` (else it weighs the row
    whole: top-k works on the k best alone, a min-p this small may keep tokens outside the
    candidates, and llama.cpp's order (``samplers``) cuts before it tempers)."""
    return (not p.greedy and p.samplers is None and not (p.top_k and p.top_k < size)
            and not 0.0 < p.min_p < _CUT_WEIGHT)


def _scan(x: np.ndarray, p: SamplingParams) -> Scan:
    """The passes over the whole row a draw starts with: the best logit, and without min-p the
    near tokens and two counts (:func:`_near`)."""
    m, t = float(x.max()), p.temperature
    if p.min_p:
        return Scan(m, t)
    near = np.flatnonzero(x >= np.float32(m - t * _CUT * _NEAR_SHARE))
    # (read now: on the engine thread, after the other rows' passes, these hundreds of reads
    # scattered over the row missed the core's cache, ~30 us a row)
    near_logits = x[near]
    n_mid = int(np.count_nonzero(x >= np.float32(m - t * _CUT * _MID_SHARE)))
    n_cut = int(np.count_nonzero(x >= np.float32(m - t * _CUT)))
    return Scan(m, t, near, near_logits, n_mid, n_cut)


def _near(x: np.ndarray, scan: Scan) -> tuple[np.ndarray, np.ndarray, float]:
    """The tokens within two thirds of the cut (12 nats) of the best, their weights, and a
    bound on the weight of all the others: the tokens counted in each band beyond (to 15
    nats, to 18, the rest) times the weight of the band's inner edge. Counting a band is a
    compare and a count, far cheaper than listing its thousands of tokens (at temperature 1,
    hundreds of tokens lie within 12 nats and tens of thousands within 18); the bound is
    tight enough to decide about 99 draws in 100 on the demo model."""
    near_cut, mid_cut = _CUT * _NEAR_SHARE, _CUT * _MID_SHARE
    near = scan.near
    assert near is not None and scan.near_logits is not None
    bound = ((scan.n_mid - near.size) * _edge_weight(near_cut)
             + (scan.n_cut - scan.n_mid) * _edge_weight(mid_cut)
             + (x.size - scan.n_cut) * _CUT_WEIGHT)
    return near, _weights(scan.near_logits, scan.best, scan.temperature), bound


def _edge_weight(nats: float) -> float:
    """The most a token beyond ``nats`` from the best weighs (the best weighs 1; the 1.001
    covers float32 rounding of the scaled logit)."""
    return math.exp(-nats) * 1.001


def _total(x: np.ndarray, m: float, temperature: float) -> float:
    return float(_weights(x, m, temperature).sum(dtype=np.float64))


@dataclass(frozen=True)
class _Cut:
    """Where a top-p cut may fall: the nucleus is ``order[:k + 1]`` for one ``k`` in
    [``first``, ``last``] (one value when the total weight is known), ``order`` holding the
    indices of the weights by decreasing weight (ties by index) as far as ``last``."""

    order: np.ndarray
    cdf: np.ndarray  # the weights' running sum in ``order``
    first: int
    last: int

    def members(self, k: int) -> np.ndarray:
        """The nucleus if the cut is at ``k``, ascending."""
        return np.sort(self.order[:min(k + 1, self.order.size)])

    def split_draw(self, head: int, u1: float, u2: float) -> int | None:
        """The position in ``order`` of the token two uniforms draw from the nucleus
        (:class:`_NucleusDraw`): among the ``head`` most likely tokens if ``u1`` times the
        nucleus's weight is less than theirs, else among the rest of the nucleus; by weight
        with ``u2`` either way. None when the cut's range leaves that open. Each question is
        a running weight passed, and a larger nucleus only moves the target further along the
        same running sum, so the smallest and the largest nucleus the cut allows decide for
        all of them."""
        cdf = self.cdf
        head = min(head, self.last + 1)  # (a head is never past the nucleus: rounding aside)
        held = float(cdf[head - 1])
        if u1 * cdf[self.last] < held:  # among the head, whichever the cut
            return min(int(np.searchsorted(cdf[:head], u2 * held, side="right")), head - 1)
        if u1 * cdf[self.first] < held:  # the head or the rest: the cut decides
            return None

        def drawn(k: int) -> int:  # among the rest of the nucleus cut at k
            return min(int(np.searchsorted(cdf, held + u2 * (cdf[k] - held), side="right")), k)

        token = drawn(self.first)
        return token if self.last == self.first or drawn(self.last) == token else None


class _NucleusDraw:
    """One top-p draw, settled by the first of the cuts tried on ever more of the row (the
    near tokens, the candidates, the exact total, the whole row) that decides it.

    The first cut tried fixes the *head*, its smallest nucleus (every cut it allows keeps
    those tokens, and so does the exact one), and the uniforms: ``u1`` for whether the token
    lies in the head (with probability the head's weight over the nucleus's), ``u2`` to draw
    it by weight there or in the rest of the nucleus (:meth:`_Cut.split_draw`). That is
    exactly a draw from the nucleus whatever the head, so long as it is fixed before the
    uniforms are known; a first cut that is exact needs no ``u1``.
    """

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self._head = 0
        self._u = (0.0, 0.0)

    def settle(self, cut: _Cut) -> int | None:
        """The index of the token among the cut's weights, or None when ``cut`` cannot tell."""
        if not self._head:
            self._head = cut.first + 1
            u1 = 0.0 if cut.first == cut.last else self._rng.random()
            self._u = (u1, self._rng.random())
        at = cut.split_draw(self._head, *self._u)
        return None if at is None else int(cut.order[at])


def _nucleus(w: np.ndarray, top_p: float, rest: float, exact: bool = False) -> _Cut | None:
    """Where the smallest most-likely set of ``w`` whose mass reaches ``top_p`` of the total
    ends, the total being ``w``'s sum plus some weight left out of ``w``: at most ``rest``, or
    exactly ``rest`` if ``exact``. None when the set could reach past ``w``. The weights above
    1% of the best, then above 0.01%, are tried before sorting everything: the nucleus is
    usually small."""
    inside = float(w.sum(dtype=np.float64))
    low = top_p * (inside + (rest if exact else 0.0))
    high = top_p * (inside + rest)
    if high > inside:
        return None
    order = None
    for level in _NUCLEUS_LEVELS:  # the weights (the best is 1) at or above a level first
        cand = np.flatnonzero(w >= level)
        if cand.size < w.size and w[cand].sum(dtype=np.float64) >= high:
            order = cand[_by_weight(w[cand])]
            break
    if order is None:
        order = _by_weight(w)
    cdf = np.cumsum(w[order], dtype=np.float64)
    end = cdf.size - 1  # (a sum in another order may round past the running sum's last)
    return _Cut(order, cdf, min(int(np.searchsorted(cdf, low)), end),
                min(int(np.searchsorted(cdf, high)), end))


def _by_weight(w: np.ndarray) -> np.ndarray:
    """The positions of the weights ``w`` (>= 0) from the largest down, ties by position: a
    stable ``argsort(-w)``, as one sort of 64-bit keys (a weight's bits, which order
    non-negative floats as integers, above its position), which numpy runs with its SIMD
    sort: 6.5 us for 1,000 weights and 16 for 3,000, where the stable argsort took 16 and
    111."""
    bits = np.asarray(w, dtype=np.float32).view(np.int32).astype(np.int64)
    bits = np.int64(0x7F800000) - bits
    key = (bits << 32) | np.arange(w.size, dtype=np.int64)
    key.sort()
    return key & 0xFFFFFFFF


def apply_penalties(logits: np.ndarray, p: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> np.ndarray:
    """llama.cpp's repeat penalty over the last ``repeat_last_n`` tokens, OpenAI's presence and
    frequency penalties over the generated tokens (``llama_penalties``: llama.cpp's, over the
    same window as the repeat penalty). Returns a new array."""
    x = np.array(logits, dtype=np.float32, copy=True)
    windowed = p.repeat_penalty != 1.0 or p.llama_penalties  # (OpenAI's alone need none)
    recent = _last(prompt_ids, output_ids, p.repeat_last_n) if windowed else []
    if p.repeat_penalty != 1.0 and recent:
        ids = np.unique(np.asarray(recent, dtype=np.int64))
        vals = x[ids]
        x[ids] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    counted = recent if p.llama_penalties else output_ids
    if (p.presence_penalty or p.frequency_penalty) and counted:
        ids, counts = np.unique(np.asarray(counted, dtype=np.int64), return_counts=True)
        x[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return x


def _last(prompt_ids: list[int], output_ids: list[int], n: int) -> list[int]:
    """The last ``n`` tokens of prompt and answer (none for 0), without copying the prompt
    whole (this runs for every row of every step)."""
    if n <= 0:
        return []
    if len(output_ids) >= n:
        return output_ids[-n:]
    return prompt_ids[-(n - len(output_ids)):] + output_ids


def token_logprob(logits: np.ndarray, token: int, n_top: int
                  ) -> tuple[float, tuple[tuple[int, float], ...], int]:
    """``token``'s log-probability under the row's own distribution, the ``n_top`` most likely
    tokens' and its rank (1 + the tokens more likely than it, as vLLM counts)."""
    found = with_logprobs(logits, token, n_top)
    assert found.logprob is not None and found.top_logprobs is not None
    rank = 1 + int(np.count_nonzero(logits > logits[token]))
    return found.logprob, found.top_logprobs, rank


def with_logprobs(logits: np.ndarray, token: int, n_top: int) -> SampledToken:
    """Log-probabilities under the model's own distribution (raw logits, as vLLM reports)."""
    lse, top = logprob_table(logits, n_top)
    return SampledToken(token, float(logits[token]) - lse, top)


def logprob_table(logits: np.ndarray, n_top: int
                  ) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The row's log-normaliser (a token's logprob is its logit less it) and its ``n_top``
    most likely tokens with their logprobs, best first."""
    row = np.asarray(logits, dtype=np.float32)
    m = float(row.max())
    lse = m + float(np.log(np.exp(row - m).sum(dtype=np.float64)))
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:  # (the k best by block maxima: a partition of the whole row cost ~3 ms)
        ids = top_candidates(row, n_top) if n_top < row.size else np.arange(row.size)
        ids = ids[np.argsort(-row[ids], kind="stable")]
        top = tuple((int(i), float(row[i]) - lse) for i in ids)
    return lse, top
