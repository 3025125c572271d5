"""Proposers and verification with no model: exact cases and a statistical check that
rejection sampling keeps the target distribution."""

import numpy as np

from justllm.spec.proposer import NgramProposer
from justllm.spec.verify import verify_greedy, verify_sampled


def test_ngram_proposes_the_latest_continuation_longest_match_first():
    p = NgramProposer(max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert p.lookup(tokens, 3) == [7, 8, 2]  # "2 3 4" last seen before "7 8 2"
    assert p.lookup([5, 6, 5], 2) == [6, 5]  # only a 1-gram matches
    assert p.lookup([1, 2, 3], 4) == []  # nothing repeats
    assert p.lookup([1], 4) == [] and p.lookup(tokens, 0) == []


def one_hot_rows(tokens, vocab=10):
    rows = np.full((len(tokens), vocab), -5.0, dtype=np.float32)
    for i, t in enumerate(tokens):
        rows[i, t] = 5.0
    return rows


def test_greedy_keeps_matching_drafts_then_the_targets_token():
    rows = one_hot_rows([4, 5, 6, 7])
    assert verify_greedy(rows, [4, 5, 6]) == verify_greedy(rows, [4, 5, 6])
    v = verify_greedy(rows, [4, 5, 6])
    assert (v.tokens, v.accepted) == ([4, 5, 6, 7], 3)  # all kept + bonus
    v = verify_greedy(rows, [4, 9, 6])
    assert (v.tokens, v.accepted) == ([4, 5], 1)  # correction at the first mismatch
    v = verify_greedy(rows[:1], [])
    assert (v.tokens, v.accepted) == ([4], 0)


def test_rejection_sampling_preserves_the_target_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.2, 0.2, 0.1])
    q = np.array([0.1, 0.6, 0.2, 0.1])  # a bad draft model
    n = 40000
    first = np.zeros(4)
    for _ in range(n):
        d = int(rng.choice(4, p=q))
        v = verify_sampled(np.stack([p, p]), [d], np.stack([q]), rng)
        first[v.tokens[0]] += 1
    assert np.abs(first / n - p).max() < 0.01


def test_deterministic_draft_rejection_sampling_preserves_the_distribution():
    rng = np.random.default_rng(1)
    p = np.array([0.3, 0.4, 0.2, 0.1])
    n = 40000
    first = np.zeros(4)
    accepted = 0
    for _ in range(n):
        v = verify_sampled(np.stack([p, p]), [1], None, rng)  # the n-gram proposer said 1
        first[v.tokens[0]] += 1
        accepted += v.accepted
    assert np.abs(first / n - p).max() < 0.01
    assert abs(accepted / n - p[1]) < 0.01  # accepted exactly with probability p(draft)
