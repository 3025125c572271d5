"""Proposers and verification with no model: exact cases and a statistical check that
rejection sampling keeps the target distribution."""

import numpy as np

from justllm.core.plan import DraftTree
from justllm.spec.proposer import NgramProposer
from justllm.spec.verify import Verdict, accept_or_resample, walk_draft


def test_ngram_proposes_the_latest_continuation_longest_match_first():
    p = NgramProposer(max_n=3, min_n=1)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert p.lookup(tokens, 3) == [7, 8, 2]  # "2 3 4" last seen before "7 8 2"
    assert p.lookup([5, 6, 5], 2) == [6, 5]  # only a 1-gram matches
    assert p.lookup([1, 2, 3], 4) == []  # nothing repeats
    assert p.lookup([1], 4) == [] and p.lookup(tokens, 0) == []
    strict = NgramProposer()  # the default: only 3- and 4-token matches propose
    assert strict.lookup([5, 6, 7, 5, 6], 2) == []
    assert strict.lookup([5, 6, 7, 8, 5, 6, 7], 2) == [8, 5]


def one_hot_rows(tokens, vocab=10):
    rows = np.full((len(tokens), vocab), -5.0, dtype=np.float32)
    for i, t in enumerate(tokens):
        rows[i, t] = 5.0
    return rows


def verify_greedy(rows: np.ndarray, draft: list[int]) -> Verdict:
    """The engine's greedy rule through the one verification path."""
    return walk_draft(DraftTree.chain(draft), lambda row, _kids: (int(np.argmax(rows[row])), False))


def verify_sampled(p_rows: np.ndarray, draft: list[int], q_rows: np.ndarray | None,
                   rng: np.random.Generator) -> Verdict:
    """The engine's sampled rule (RequestSampler: accept_or_resample against the one child,
    a plain draw after the last) through the one verification path."""
    tree = DraftTree.chain(draft)

    def step(row: int, kids: tuple[int, ...]) -> tuple[int, bool]:
        p = p_rows[row]
        if kids:
            k = kids[0]
            return accept_or_resample(p, tree.tokens[k], None if q_rows is None else q_rows[k],
                                      rng), False
        return int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right")), False

    return walk_draft(tree, step)


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


def test_walk_draft_follows_the_branch_the_target_takes():
    # root -> {4, 6}; 4 -> 5; 6 -> 7 -> 8. The target says 6, 7, 9.
    tree = DraftTree((4, 6, 5, 7, 8), (-1, -1, 0, 1, 3))
    target = {0: 6, 2: 7, 4: 9}  # row (0: root, i + 1: node i) -> the target's token
    seen = []

    def step(row, kids):
        seen.append((row, kids))
        return target[row], False

    v = walk_draft(tree, step)
    assert (v.tokens, v.accepted, v.path) == ([6, 7, 9], 2, (1, 3))
    assert seen == [(0, (0, 1)), (2, (3,)), (4, (4,))]
    # a stop after the first token ends the walk even on a match
    v = walk_draft(tree, lambda row, kids: (target[row], True))
    assert (v.tokens, v.accepted, v.path) == ([6], 1, (1,))


def test_draft_tree_shape_helpers():
    from justllm.core.plan import DraftTree

    t = DraftTree((4, 6, 5, 7, 8), (-1, -1, 0, 1, 3))
    assert t.depths == (1, 1, 2, 2, 3) and t.leaves == (2, 4) and not t.is_chain
    assert t.node_leaves == ((0,), (1,), (0,), (1,), (1,))
    assert t.truncated(3).tokens == (4, 6, 5) and t.truncated(3).leaves == (1, 2)
    assert t.first_branch().tokens == (4, 5) and t.first_branch().is_chain
    assert DraftTree.chain([1, 2]).parents == (-1, 0)


def test_ngram_proposer_batches_requests():
    from justllm.core.sampling_params import SamplingParams
    from justllm.spec.proposer import DraftRequest

    p = NgramProposer(min_n=1)
    out = p.propose([DraftRequest("a", [1, 2, 3, 1, 2], 2, SamplingParams()),
                     DraftRequest("b", [1, 2, 3], 2, SamplingParams())])
    assert list(out) == ["a"] and out["a"].tokens == (3, 1)


def test_window_grows_shrinks_and_pauses():
    from justllm.spec.window import SpecWindow

    w = SpecWindow(4)
    assert w.want(1) == 4
    w.record(4, 1, 1)
    assert w.want(2) == 2  # one more than was accepted
    w.record(2, 2, 2)
    assert w.want(3) == 3  # full acceptance grows it
    w.record(3, 0, 3)
    assert w.want(4) == 1
    w.record(1, 0, 4)  # two misses: paused, until step 16 (a multiple of 8, >= 8 steps on)
    assert [w.want(t) for t in range(5, 17)] == [0] * 11 + [1]
    w.record(1, 0, 16)  # the probe missed: paused again, for 16-32 steps, until step 48
    assert [w.want(t) for t in range(17, 49)] == [0] * 31 + [1]
    w.record(1, 1, 48)  # a hit ends the backoff
    assert w.want(49) == 2
    w.record(2, 0, 49)
    w.record(1, 0, 50)
    assert w.want(63) == 0 and w.want(64) == 1  # back to pauses of 8
    assert SpecWindow(0).want(1) == 0


def test_windows_that_back_off_together_probe_together():
    from justllm.spec.window import SpecWindow

    a, b = SpecWindow(2), SpecWindow(2)
    a.record(2, 0, 3)
    a.record(1, 0, 4)
    b.record(2, 0, 6)
    b.record(1, 0, 7)
    assert [t for t in range(8, 40) if a.want(t)][0] == [t for t in range(8, 40) if b.want(t)][0] == 16


def test_window_starts_in_backoff_when_recent_drafts_were_poor():
    from justllm.spec.window import SpecWindow

    assert SpecWindow(4, recent_acceptance=None, step=5).want(6) == 4
    assert SpecWindow(4, recent_acceptance=0.6, step=5).want(6) == 4
    poor = SpecWindow(4, recent_acceptance=0.05, step=5)
    assert [poor.want(t) for t in range(6, 65)] == [0] * 58 + [1]  # one probe, at step 64
    poor.record(1, 0, 64)
    assert [t for t in range(65, 400) if poor.want(t)][0] == 192  # 64 more, on a multiple


def test_new_requests_start_in_backoff_only_on_enough_poor_drafts():
    """One rejected first draft set the recent rate to 0: every request after it started in
    backoff, and the 5% average took dozens of good drafts to lift it past 20%."""
    from justllm.core.plan import DraftTree
    from justllm.core.sampling_params import SamplingParams
    from justllm.spec.controller import RECENT_EVIDENCE, SpecController

    spec = SpecController(_Silent(), gamma=4, max_nodes=4, p_min=0.0, n_vocab=100)
    draft = DraftTree.chain([1, 2, 3, 4])
    spec.admit("first", SamplingParams(), 0)
    spec.record("first", draft, 0, 1)  # rejected whole
    spec.admit("next", SamplingParams(), 2)
    assert spec._windows["next"].want(3) == 4  # one draft is no evidence: it drafts
    for step in range(RECENT_EVIDENCE - 1):  # then half of each draft kept: 0, .5, .5, ...
        spec.record("first", draft, 2, step + 3)
    assert abs(spec._recent - 0.5 * (RECENT_EVIDENCE - 1) / RECENT_EVIDENCE) < 1e-9  # the mean
    spec.admit("later", SamplingParams(), 20)
    assert spec._windows["later"].want(21) == 4  # above 20%: no backoff
    for step in range(200):
        spec.record("first", draft, 0, step + 30)
    spec.admit("poor", SamplingParams(), 300)
    assert spec._windows["poor"].want(301) == 0  # many rejected drafts: it starts in backoff


def test_no_draft_reaches_past_the_last_token_a_request_may_make():
    """A request 2 tokens from max_tokens was drafted 4 deep: drafted and verified for
    nothing (a step makes the accepted drafts and one token more)."""
    from justllm.core.request import Request
    from justllm.core.sampling_params import SamplingParams
    from justllm.spec.controller import SpecController

    spec = SpecController(_Silent(), gamma=4, max_nodes=4, p_min=0.0, n_vocab=100)
    reqs = []
    for name, max_tokens, made in (("far", 100, 8), ("near", 10, 8), ("last", 10, 9),
                                   ("open", None, 8)):
        req = Request(name, [1, 2, 3], SamplingParams(max_tokens=max_tokens), 0, 512,
                      output_token_ids=[5] * made)
        spec.admit(name, req.params, 0)
        reqs.append(req)
    assert {w.request_id: w.k for w in spec.wants(reqs, 1)} == {"far": 4, "near": 1,
                                                                  "open": 4}


class _Silent:
    """A proposer that drafts nothing (the controller's own bookkeeping is tested)."""

    costly = False

    def propose(self, wants):
        return {}

    def release(self, request_id):
        pass
