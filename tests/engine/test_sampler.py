"""Numpy sampling on synthetic logits (pure logic, no model)."""

import dataclasses

import numpy as np
import pytest

from justllm.core.sampling_params import SamplingParams
from justllm.engine.sampler import (
    InfillVocab,
    RequestSampler,
    apply_penalties,
    infill_keep,
    with_logprobs,
)


def logits_from_probs(p):
    return np.log(np.asarray(p, dtype=np.float64)).astype(np.float32)


def draw(params, logits, n, seed=0):
    s = RequestSampler(params, seed)
    return np.array([s.sample(logits, [], []).token_id for _ in range(n)])


def test_greedy_is_argmax():
    x = np.array([0.1, 3.0, 2.9, -1], dtype=np.float32)
    assert RequestSampler(SamplingParams(), 0).sample(x, [], []).token_id == 1


def test_temperature_one_matches_distribution():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    got = np.bincount(draw(SamplingParams(temperature=1.0), logits_from_probs(p), 20000), minlength=4) / 20000
    assert np.abs(got - p).max() < 0.015


def test_top_k_and_top_p_and_min_p_cut_the_tail():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    x = logits_from_probs(p)
    assert set(draw(SamplingParams(temperature=1.0, top_k=2), x, 2000)) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.75), x, 2000)) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.25), x, 2000)) == {0, 1, 2}
    # top_p 0 (OpenAI's and Ollama's clients send it; llama.cpp keeps one token): the best
    assert set(draw(SamplingParams(temperature=1.5, top_p=0), x, 500)) == {0}


def test_top_p_on_a_large_vocabulary_uses_the_same_nucleus():
    rng = np.random.default_rng(1)
    x = rng.normal(size=300_000).astype(np.float32)
    x[:5] += 30  # five tokens hold nearly all the mass
    toks = draw(SamplingParams(temperature=1.0, top_p=0.9), x, 200)
    assert set(toks) <= {0, 1, 2, 3, 4}
    flat = np.zeros(300_000, dtype=np.float32)  # uniform: every token is a candidate
    toks = draw(SamplingParams(temperature=1.0, top_p=0.5), flat, 20)
    assert toks.max() < 150_001


def test_seed_reproduces_and_differs_across_seeds():
    x = np.zeros(1000, dtype=np.float32)
    a = draw(SamplingParams(temperature=1.0), x, 50, seed=42)
    b = draw(SamplingParams(temperature=1.0), x, 50, seed=42)
    c = draw(SamplingParams(temperature=1.0), x, 50, seed=43)
    assert (a == b).all() and not (a == c).all()


def test_penalties():
    x = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    out = apply_penalties(x, SamplingParams(repeat_penalty=2.0), [0, 1], [])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    out = apply_penalties(x, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [], [2, 2, 3])
    assert out.tolist() == pytest.approx([2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25])
    assert x.tolist() == [2.0, -2.0, 1.0, 0.5]  # input untouched


def test_logprobs_are_log_softmax():
    p = np.array([0.5, 0.3, 0.2])
    s = with_logprobs(logits_from_probs(p), 1, 2)
    assert s.logprob == pytest.approx(np.log(0.3), abs=1e-5)
    assert [t for t, _ in s.top_logprobs] == [0, 1]
    assert s.top_logprobs[0][1] == pytest.approx(np.log(0.5), abs=1e-5)


def testinverse_cdf_two_levels_matches_a_plain_cumsum():
    from justllm.engine.sampler import inverse_cdf

    rng = np.random.default_rng(0)
    probs = rng.random(262_144).astype(np.float32)
    probs /= probs.sum()
    cdf = np.cumsum(probs, dtype=np.float64)
    for u in (0.0, 1e-9, 0.25, 0.5, 0.999999, rng.random(), rng.random()):
        expected = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), probs.size - 1)
        assert abs(inverse_cdf(probs, u) - expected) <= 1  # float rounding at a boundary


def test_large_vocabulary_temperature_sampling_matches_distribution():
    rng = np.random.default_rng(2)
    x = rng.normal(size=100_000).astype(np.float32)
    x[7] += 6.0  # one token holds a known share of the mass
    p = np.exp(x - x.max()).astype(np.float64)
    p /= p.sum()
    toks = draw(SamplingParams(temperature=1.0), x, 3000)
    assert abs((toks == 7).mean() - p[7]) < 0.03


def test_logit_bias_moves_greedy_and_sampled_choices_without_touching_the_row():
    x = np.array([0.1, 3.0, 2.9, -1], dtype=np.float32)
    row = x.copy()
    assert RequestSampler(SamplingParams(logit_bias={1: -100}), 0).sample(x, [], []).token_id == 2
    assert RequestSampler(SamplingParams(logit_bias={3: 100}), 0).sample(x, [], []).token_id == 3
    forced = draw(SamplingParams(temperature=1.0, logit_bias={0: 100}), x, 200)
    assert (forced == 0).all()
    banned = draw(SamplingParams(temperature=1.0, logit_bias={1: -100, 2: -100}), x, 500)
    assert set(banned.tolist()) <= {0, 3} and (banned == 0).any()
    assert np.array_equal(x, row)  # the batch's logits row is left as it was
    # logprobs stay those of the model's own distribution
    lp = RequestSampler(SamplingParams(logprobs=1, logit_bias={3: 100}), 0).sample(x, [], [])
    assert lp.token_id == 3 and lp.top_logprobs[0][0] == 1


@pytest.mark.parametrize(("n", "k"), [(262_144, 40), (262_144, 1024), (262_144, 16_384),
                                      (300_001, 40), (1000, 999), (5, 2)])
def test_top_candidates_are_exactly_the_k_largest_in_ascending_order(n, k):
    from justllm.engine.sampler import top_candidates

    x = np.random.default_rng(n + k).normal(size=n).astype(np.float32)
    x[-1] = x.max() + 1  # the best value in the ragged tail past the last full block
    got = top_candidates(x, k)
    assert got.tolist() == sorted(np.argpartition(-x, k - 1)[:k].tolist())
    assert n - 1 in got


def test_top_k_and_top_p_on_a_large_vocabulary_draw_from_the_renormalised_set():
    rng = np.random.default_rng(7)
    x = rng.normal(size=100_000).astype(np.float32)
    best = rng.choice(100_000, size=4, replace=False)
    x[best] = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32)) + 20
    want = np.array([0.4, 0.3, 0.2, 0.1])
    for params in (SamplingParams(temperature=1.0, top_k=4),
                   SamplingParams(temperature=1.0, top_p=0.999),  # the tail: ~3e-4
                   SamplingParams(temperature=1.0, top_k=40, top_p=0.999)):
        toks = draw(params, x, 3000, seed=11)
        assert set(toks.tolist()) <= set(best.tolist()), params
        got = np.array([(toks == b).mean() for b in best])
        assert np.abs(got - want).max() < 0.03, (params, got)


class _OnlyThese:
    """A constraint allowing a fixed set of tokens, counting full-row masks."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed, self.masks = allowed, 0
        self.active = True

    def mask(self, logits):
        self.masks += 1
        out = np.full_like(logits, -np.inf)
        ids = sorted(self.allowed)
        out[ids] = logits[ids]
        return out

    def allows(self, token: int) -> bool:
        return token in self.allowed

    def allowed_argmax(self, logits):
        return int(np.argmax(self.mask(logits)))

    def accept(self, token: int) -> None:
        pass


def test_a_constrained_sampled_draw_masks_only_when_the_draw_is_refused():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    c = _OnlyThese({0, 1, 3})
    s = RequestSampler(SamplingParams(temperature=1.0), 5, c)
    toks = np.array([s.sample(logits_from_probs(p), [], []).token_id for _ in range(20000)])
    got = np.bincount(toks, minlength=4) / toks.size
    want = np.array([0.5, 0.3, 0.0, 0.05]) / 0.85  # exactly p restricted to what is allowed
    assert np.abs(got - want).max() < 0.015 and got[2] == 0
    assert 0.12 < c.masks / 20000 < 0.18  # a mask only for the ~15% of draws that were refused


def exact_distribution(x, params):
    """The sampling distribution written out the plain way: softmax at the temperature over
    the whole row, then top-k, min-p, top-p (the order the sampler documents)."""
    w = np.exp((x.astype(np.float64) - x.max()) / params.temperature)
    keep = np.ones(x.size, dtype=bool)
    if params.top_k:
        keep[np.argsort(-w, kind="stable")[params.top_k:]] = False
    if params.min_p:
        keep &= w >= params.min_p * w.max()
    if params.top_p < 1.0:
        order = [i for i in np.argsort(-w, kind="stable") if keep[i]]
        cdf = np.cumsum(w[order])
        cut = int(np.searchsorted(cdf, params.top_p * cdf[-1])) + 1
        keep[:] = False
        keep[order[:cut]] = True
    w = np.where(keep, w, 0.0)
    return w / w.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),  # the tail drawn as a region of its own
    SamplingParams(temperature=0.7, top_p=0.9),  # cuts the bound leaves undecided
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.05),  # min-p within the candidates
    SamplingParams(temperature=1.0, min_p=0.01),  # min-p below the cut: the whole row
    SamplingParams(temperature=1.0, top_k=12, top_p=0.8)])
def test_draws_from_the_candidates_are_distributed_exactly_as_the_whole_row(monkeypatch, params):
    """With a cut of 2 nats, most of the mass lies outside the candidates, so every branch that
    weighs the rest (and each of its orders of tokens) is taken many times: a wrong one shows as
    a distribution off the exact one."""
    import justllm.engine.sampler as sampler

    monkeypatch.setattr(sampler, "_CUT", 2.0)
    monkeypatch.setattr(sampler, "_CUT_WEIGHT", float(np.exp(-2.0)) * 1.001)
    x = (np.random.default_rng(5).normal(size=40) * 1.5).astype(np.float32)
    want = exact_distribution(x, params)
    got = np.bincount(draw(params, x, 40_000, seed=3), minlength=x.size) / 40_000
    assert np.abs(got - want).max() < 0.01, (got - want).round(3)
    assert set(np.flatnonzero(got)) == set(np.flatnonzero(want))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=8),
    SamplingParams(temperature=0.8, top_k=12, top_p=0.8),
    SamplingParams(temperature=1.2, top_k=20, min_p=0.02)])
def test_draws_from_graph_candidates_are_the_whole_rows_or_undecided(params):
    """RequestSampler.draw_candidates (--backend-sampling's top-p rows): from the best 30 of
    40 tokens with their probabilities under the whole row's softmax (what the graph's
    candidate sampler hands over), the draws are distributed exactly as the whole row's;
    from the best 3 the nucleus reaches past them, so every draw is undecided (None) and uses
    no uniform, the generator left as it was (the host then draws from the row)."""
    x = (np.random.default_rng(5).normal(size=40) * 1.5).astype(np.float32)
    w = np.exp((x.astype(np.float64) - x.max()) / params.temperature)
    probs = w / w.sum()
    order = np.argsort(-probs, kind="stable")
    want = exact_distribution(x, params)

    def candidates(k):
        ids = order[:k][::-1].copy()  # (in no particular order)
        return ids, probs[ids].astype(np.float32), float(probs[order[k]])  # the bound

    s = RequestSampler(params, 3)
    got = np.bincount([s.draw_candidates(*candidates(30)) for _ in range(40_000)],
                      minlength=x.size) / 40_000
    assert np.abs(got - want).max() < 0.01, (got - want).round(3)
    assert set(np.flatnonzero(got)) == set(np.flatnonzero(want))
    state = s.rng.bit_generator.state
    assert all(s.draw_candidates(*candidates(3)) is None for _ in range(10))
    assert s.rng.bit_generator.state == state


@pytest.fixture
def weighed(monkeypatch) -> list[int]:
    """The sizes of the rows the sampler computes weights of, one entry per call."""
    import justllm.engine.sampler as sampler

    sizes: list[int] = []
    whole = sampler._weights

    def counting(x, m, t):
        sizes.append(x.size)
        return whole(x, m, t)

    monkeypatch.setattr(sampler, "_weights", counting)
    return sizes


def test_the_whole_row_is_weighed_only_when_the_rest_could_change_the_draw(weighed):
    """On a 262k row shaped like the demo model's (a few likely tokens, a broad tail), a
    top-p draw weighs only the candidates unless a cut lands within reach of the bound."""
    rng = np.random.default_rng(9)
    x = (rng.normal(size=262_144) * 3.0).astype(np.float32)
    x[rng.choice(x.size, 20, replace=False)] += 25.0
    toks = draw(SamplingParams(temperature=0.8, top_p=0.95), x, 50)
    assert np.all(x[toks] > x.max() - 30)
    assert len(weighed) >= 50 and max(weighed) < 262_144


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, min_p=0.2),
                                    SamplingParams(temperature=0.6, min_p=0.05, top_p=0.7)])
def test_min_p_draws_weigh_only_what_min_p_keeps_and_stay_exact(weighed, params):
    """With min-p the candidates stop at ln(1/min_p) nats from the best (after temperature),
    not at the general cut: few tokens are weighed, and the draws are still the exact
    distribution (a token just within the min-p boundary included)."""
    x = (np.random.default_rng(5).normal(size=40) * 1.5).astype(np.float32)
    x[7] = x.max() + params.temperature * np.log(params.min_p) + 1e-4  # just within the cut
    want = exact_distribution(x, params)
    got = np.bincount(draw(params, x, 40_000, seed=3), minlength=x.size) / 40_000
    assert np.abs(got - want).max() < 0.01, (got - want).round(3)
    assert set(np.flatnonzero(got)) == set(np.flatnonzero(want))
    within = int(np.count_nonzero(x >= x.max() + params.temperature * np.log(params.min_p)
                                  - 1e-3))
    assert max(weighed) <= within + 1 < x.size


def two_step_nucleus_draw(w, top_p, head, u1, u2):
    """A top-p draw in two steps written out the plain way: the nucleus (the most likely
    tokens, ties by index, until their weight reaches top_p of the total), its ``head`` most
    likely tokens with the probability of their share of it (``u1``), then by weight there or
    in the rest of the nucleus (``u2``)."""
    order = np.lexsort((np.arange(w.size), -w))
    cdf = np.cumsum(w[order], dtype=np.float64)
    k = min(int(np.searchsorted(cdf, top_p * float(w.sum(dtype=np.float64)))), w.size - 1)
    held = cdf[head - 1]
    if u1 * cdf[k] < held:
        at = min(int(np.searchsorted(cdf[:head], u2 * held, side="right")), head - 1)
    else:
        at = min(int(np.searchsorted(cdf, held + u2 * (cdf[k] - held), side="right")), k)
    return int(order[at])


def test_a_top_p_draw_is_the_token_the_whole_row_gives_for_the_same_uniforms(monkeypatch):
    """A top-p draw from the near tokens or the candidates is not just distributed like the
    whole row's: for the same uniforms (the request's generator's next, the first only when the
    first cut tried is open) and head (that cut's smallest nucleus, within the exact one) it is
    the same token, including when the first uniform falls where only the exact weight can
    tell and the sampler goes on to the candidates, then weighs the rest. A short cut makes
    those cases common."""
    import justllm.engine.sampler as sampler

    monkeypatch.setattr(sampler, "_CUT", 12.0)
    monkeypatch.setattr(sampler, "_CUT_WEIGHT", float(np.exp(-12.0)) * 1.001)
    seen = {"open": 0, "weighed": 0, "settled": []}
    settle, total = sampler._NucleusDraw.settle, sampler._total

    def recording_settle(self, cut):
        token = settle(self, cut)
        seen["open"] += token is None
        seen["settled"].append((self._head, self._u))
        return token

    def counting_total(*args):
        seen["weighed"] += 1
        return total(*args)

    monkeypatch.setattr(sampler._NucleusDraw, "settle", recording_settle)
    monkeypatch.setattr(sampler, "_total", counting_total)
    rng = np.random.default_rng(11)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    fast, uniforms = RequestSampler(params, 5), np.random.default_rng(5)
    for _ in range(3000):
        x = (rng.normal(size=4096) * 2.0).astype(np.float32)
        x[rng.choice(x.size, 8, replace=False)] += rng.uniform(4.0, 9.0, size=8).astype(np.float32)
        seen["settled"].clear()
        token = fast._draw(x)
        (head, (u1, u2)), = set(seen["settled"])  # fixed by the first cut tried
        assert u1 == (0.0 if u1 == 0.0 else uniforms.random()) and u2 == uniforms.random()
        w = sampler._weights(x, float(x.max()), params.temperature)
        exact = int(np.searchsorted(np.cumsum(np.sort(w)[::-1], dtype=np.float64),
                                    params.top_p * float(w.sum(dtype=np.float64)))) + 1
        assert 1 <= head <= exact
        assert token == two_step_nucleus_draw(w, params.top_p, head, u1, u2)
    # both ways out of an open cut were taken, many times
    assert seen["open"] > 25 and 5 < seen["weighed"] < seen["open"] - 5, (seen["open"], seen["weighed"])


def test_pure_temperature_draws_in_nested_regions_are_exact_on_every_path(monkeypatch, weighed):
    """Pure temperature decides the region of the draw from a bound first (the near tokens
    alone weighed), then from the candidates within the cut, then from the whole row. With a
    3-nat cut on 40 tokens each way is taken hundreds of times, and the draws are the exact
    distribution all the same."""
    import justllm.engine.sampler as sampler

    monkeypatch.setattr(sampler, "_CUT", 3.0)
    monkeypatch.setattr(sampler, "_CUT_WEIGHT", float(np.exp(-3.0)) * 1.001)
    x = (np.random.default_rng(5).normal(size=40) * 1.5).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    s = RequestSampler(params, 3)
    paths, toks = [], []
    for _ in range(40_000):
        weighed.clear()
        toks.append(s.sample(x, [], []).token_id)
        paths.append(len(weighed))  # 1: near tokens only, 2: and the band, 3: the whole row
    counts = np.bincount(paths, minlength=4)
    assert counts[1] > 10_000 and counts[2] > 1_000 and counts[3] > 5_000, counts
    got = np.bincount(toks, minlength=x.size) / len(toks)
    want = exact_distribution(x, params)
    assert np.abs(got - want).max() < 0.01, (got - want).round(3)
    assert set(np.flatnonzero(got)) == set(np.flatnonzero(want))


def test_a_pure_temperature_draw_weighs_the_near_tokens_not_every_candidate(weighed):
    """On a 262k row shaped like the demo model's (a few likely tokens, a broad tail) a
    temperature-1 draw weighs the tokens within 12 nats of the best, not the thousands within
    the 18-nat cut, nor the whole row: two compares count the band between."""
    rng = np.random.default_rng(9)
    x = (rng.normal(size=262_144) * 3.0).astype(np.float32)
    x[rng.choice(x.size, 20, replace=False)] = x.max() + rng.uniform(6.0, 9.0, size=20)
    near = int(np.count_nonzero(x >= x.max() - 12.0))
    assert int(np.count_nonzero(x >= x.max() - 18.0)) > 20 * near
    toks = draw(SamplingParams(temperature=1.0), x, 200)
    assert np.all(x[toks] >= x.max() - 18.0)
    assert len(weighed) >= 200 and sum(size > near for size in weighed) <= 10, weighed


def test_a_cut_left_open_answers_only_what_every_nucleus_it_allows_draws():
    """``split_draw`` answers for all the cuts a bound leaves open from the smallest and the
    largest nucleus alone: when it answers, the two-step draw from every nucleus the cut
    allows is that token (written out the plain way for each); when it does not, two of them
    differ; and it answers for most draws."""
    from justllm.engine.sampler import _nucleus

    rng = np.random.default_rng(4)
    answered = tried = 0
    for _ in range(600):
        w = np.exp(rng.normal(size=300) * 2.0).astype(np.float32)
        w /= w.max()
        found = _nucleus(w, 0.9, float(rng.uniform(0.0, 0.3)) * float(w.sum()))
        if found is None or found.last - found.first < 2:
            continue
        head = int(rng.integers(1, found.first + 2))
        u1, u2 = rng.random(), rng.random()
        tried += 1
        at = found.split_draw(head, u1, u2)
        drawn = set()
        for k in range(found.first, found.last + 1):
            nucleus = found.order[:k + 1]  # that cut's nucleus, as a row of its own
            top_p = (found.cdf[k] - w[found.order[k]] / 2) / float(w[nucleus].sum(dtype=np.float64))
            drawn.add(int(nucleus[two_step_nucleus_draw(w[nucleus], top_p, head, u1, u2)]))
        if at is None:
            assert len(drawn) > 1
        else:
            answered += 1
            assert drawn == {int(found.order[at])}
    assert tried > 100 and answered > tried // 2, (answered, tried)


def llama_cpp_distribution(x, params):
    """llama.cpp's chain written out the plain way: each step of ``params.samplers`` in turn
    on the softmax of what is left at the temperature so far."""
    alive = np.ones(x.size, dtype=bool)
    t = 1.0
    for step in params.samplers:
        w = np.where(alive, np.exp((x.astype(np.float64) - x[alive].max()) / t), 0.0)
        order = [i for i in np.argsort(-w, kind="stable") if alive[i]]
        if step == "temperature":
            t *= params.temperature
        elif step == "top_k" and params.top_k:
            alive[order[params.top_k:]] = False
        elif step == "min_p" and params.min_p:
            alive &= w >= params.min_p * w.max()
        elif step == "top_p" and params.top_p < 1.0:
            cdf = np.cumsum(w[order])
            alive[order[int(np.searchsorted(cdf, params.top_p * cdf[-1])) + 1:]] = False
    w = np.where(alive, np.exp((x.astype(np.float64) - x[alive].max()) / t), 0.0)
    return w / w.sum()


def distribution(params, x):
    ids, w = RequestSampler(params, 0)._distribution(x)
    dense = np.zeros(x.size)
    dense[slice(None) if ids is None else ids] = w / w.sum(dtype=np.float64)
    return dense


LLAMA_ORDER = ("top_k", "top_p", "min_p", "temperature")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=2.0, top_p=0.5, samplers=LLAMA_ORDER),
    SamplingParams(temperature=0.5, min_p=0.2, samplers=LLAMA_ORDER),
    SamplingParams(temperature=1.5, top_k=10, top_p=0.8, min_p=0.05, samplers=LLAMA_ORDER),
    SamplingParams(temperature=1.5, top_k=10, top_p=0.8, samplers=(
        "temperature", "top_p", "top_k", "temperature")),  # tempered twice, cut between
    SamplingParams(temperature=0.8, top_k=2, top_p=0.3, samplers=("temperature",)),  # no cuts
])
def test_llama_cpps_order_cuts_the_distribution_each_step_left(params):
    """llama-server's ``samplers``: with temperature last, top-p and min-p cut the untempered
    distribution (a different set than OpenAI's order cuts), a step left out does not apply,
    and draws follow the exact distribution."""
    x = (np.random.default_rng(11).normal(size=40) * 1.5).astype(np.float32)
    want = llama_cpp_distribution(x, params)
    assert np.abs(distribution(params, x) - want).max() < 1e-6
    openai_order = dataclasses.replace(params, samplers=None)
    assert np.abs(distribution(openai_order, x) - want).max() > 0.01  # the order matters here
    got = np.bincount(draw(params, x, 40_000, seed=4), minlength=x.size) / 40_000
    assert np.abs(got - want).max() < 0.01 and set(np.flatnonzero(got)) == set(
        np.flatnonzero(want))


def test_llama_cpps_order_on_a_large_vocabulary_is_seeded_and_greedy_at_zero():
    x = (np.random.default_rng(2).normal(size=262_144) * 3).astype(np.float32)
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, samplers=LLAMA_ORDER)
    assert list(draw(p, x, 50, seed=9)) == list(draw(p, x, 50, seed=9))
    assert set(draw(p, x, 500, seed=1)) <= set(np.argsort(-x)[:40])
    greedy = SamplingParams(temperature=0.0, samplers=LLAMA_ORDER)
    assert set(draw(greedy, x, 5)) == {int(np.argmax(x))}
    with pytest.raises(Exception, match="samplers"):
        SamplingParams(samplers=("top_k", "mirostat"))


# ---- llama.cpp's infill step -----------------------------------------------------------------

PIECES = {0: b"", 1: b"re", 2: b"return", 3: b"ret", 4: b"x", 5: b"y", 6: b"z", 7: b"a",
          8: b"b", 9: b"c"}
INFILL = InfillVocab(piece=PIECES.__getitem__, is_eog=lambda t: t == 0, end=0)


def kept(probs: dict[int, float]) -> list[int] | None:
    """The ids the infill step keeps of candidates with these probabilities (None: the end
    alone)."""
    ids = np.array(list(probs))
    keep = infill_keep(logits_from_probs(list(probs.values())), ids, INFILL)
    return None if keep is None else sorted(ids[keep].tolist())


def test_infill_keeps_only_the_end_when_it_is_likely_enough():
    assert kept({1: 0.4, 4: 0.3, 0: 0.3}) == [0]  # 3 x 0.3 x 3 candidates > the text's 0.7
    # else text tokens under 0.2 go (y), the end tokens stay
    assert kept({1: 0.5, 4: 0.3, 5: 0.18, 0: 0.02}) == [0, 1, 4]


def test_infill_merges_a_token_into_the_likelier_one_its_text_begins_or_is_begun_by():
    # "re" takes "ret" and "return" (each less likely): 0.18 + 0.15 + 0.1 > 0.2
    assert kept({4: 0.3, 1: 0.18, 3: 0.15, 2: 0.1, 5: 0.17, 6: 0.1}) == [1, 4]
    # "return" (0.3) is likelier than "re" (0.24): "re" gives it its weight and goes
    assert kept({2: 0.3, 1: 0.24, 4: 0.28, 5: 0.18}) == [2, 4]


def test_infill_then_cuts_what_is_under_one_over_the_text_tokens_left_plus_one():
    # all three pass 0.2; renormalised, y and z are under 1/4
    assert kept({4: 0.55, 5: 0.23, 6: 0.22}) == [4]
    assert kept({4: 0.4, 5: 0.3, 6: 0.3}) == [4, 5, 6]


def sampled(top_k: int) -> RequestSampler:
    return RequestSampler(SamplingParams(temperature=1.0, top_k=top_k,
                                         samplers=("top_k", "infill")), 0, infill=INFILL)


def test_infill_ends_when_no_text_token_is_left_likely():
    assert kept({4: 0.19, 5: 0.19, 6: 0.19, 7: 0.19, 8: 0.19, 0: 0.05}) is None
    # six even candidates after top-k, each under 0.2: the end token, though top-k cut it
    x = logits_from_probs([0.004, 0.002, 0.002, 0.002] + [0.165] * 6)
    assert sampled(6).sample(x, [], []).token_id == 0


def test_an_infill_draw_weighs_what_stays_by_its_own_logit():
    """re, ret and return merge (0.029 < 0.2, gone); x, y and the end stay, drawn by their
    own probabilities (llama.cpp's draw reads the logits, not the merged weights)."""
    x = logits_from_probs([0.005, 0.005, 0.004, 0.02, 0.5, 0.466])
    s = sampled(6)
    got = np.bincount([s.sample(x, [], []).token_id for _ in range(4000)], minlength=6) / 4000
    assert got[[1, 2, 3]].sum() == 0 and abs(got[4] - 0.5 / 0.971) < 0.03
    assert 0 < got[0] < 0.02
