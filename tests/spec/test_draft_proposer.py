"""The draft model's proposer (engine/draft_model.py) over a stand-in backend (pure logic:
which tokens it decodes, in which batches, and what it keeps between steps)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from justllm.core.sampling_params import SamplingParams
from justllm.engine.draft_model import DraftModelProposer
from justllm.errors import EngineError
from justllm.spec.proposer import DraftRequest

VOCAB = 50
GREEDY = SamplingParams(temperature=0.0)


class Backend:
    """A draft context whose every logits row has two strong tokens (trees branch), that
    fails its ``fail_at``-th decode, and records each decode's size."""

    def __init__(self, n_batch: int, n_seq_max: int, fail_at: int | None = None) -> None:
        self.config = SimpleNamespace(n_batch=n_batch, n_seq_max=n_seq_max)
        self.batch_tokens = np.zeros(n_batch, np.int32)
        self.batch_pos = np.zeros(n_batch, np.int32)
        self.batch_seq = np.zeros(n_batch, np.int32)
        self.batch_n_seq = np.zeros(n_batch, np.int32)
        self.batch_logits = np.zeros(n_batch, np.int8)
        self.fail_at = fail_at
        self.sizes: list[int] = []

    def decode(self, n: int) -> list[np.ndarray]:
        self.sizes.append(n)
        if self.fail_at is not None and len(self.sizes) == self.fail_at:
            raise EngineError("llama_decode failed")
        row = np.full(VOCAB, -10.0)
        row[1], row[2] = 1.0, 0.9
        return [row.copy() for _ in range(int(self.batch_logits[:n].sum()))]

    def seq_rm(self, *args: object) -> None:
        pass

    def seq_cp(self, *args: object) -> None:
        pass

    def clear_kv(self) -> None:
        pass


def test_a_level_of_more_drafts_than_the_batch_holds_is_decoded_in_parts():
    """8 requests drafting at once with --n-batch 4: a ValueError (broadcast into the batch's
    arrays) that switched speculation off without a word."""
    backend = Backend(n_batch=4, n_seq_max=8)
    proposer = DraftModelProposer(backend, 8)
    drafts = proposer.propose([DraftRequest(f"r{i}", [3, 4, 5], 3, GREEDY) for i in range(8)])
    assert sorted(drafts) == [f"r{i}" for i in range(8)]
    assert all(d.tokens == (1, 1, 1) for d in drafts.values())
    assert max(backend.sizes) <= 4


def test_a_failed_tree_draft_gives_its_branch_sequences_back():
    """An EngineError mid-draft kept the temporary sequences its branches had taken: after a
    few failures every tree was a chain."""
    backend = Backend(n_batch=512, n_seq_max=8, fail_at=3)
    proposer = DraftModelProposer(backend, 2, tree=True, branch=2)
    free = sorted(proposer._temp_seqs)
    want = [DraftRequest("a", [3, 4, 5], 4, GREEDY)]
    assert proposer.propose(want) == {}  # the failure: no draft, the context reset
    assert sorted(proposer._temp_seqs) == free
    tree = proposer.propose(want)["a"]
    assert len(tree.leaves) > 1  # still a tree


def test_a_sampled_draft_under_a_cut_off_is_verified_against_what_it_was_drawn_from():
    """With --draft-p-min (or speculative.p_min), a drawn token under the cut-off ends the
    draft: a drafted token was drawn from q among the tokens at or above it. Its draft
    distribution was q itself, so verification accepted those tokens too often (an audit
    measured P(".") 0.83 where the model gives 0.58)."""
    backend = Backend(n_batch=64, n_seq_max=4)
    proposer = DraftModelProposer(backend, 2)
    sampled = SamplingParams(temperature=1.0, seed=3)
    row = np.full(VOCAB, -10.0)
    row[1], row[2] = 1.0, 0.9
    q = np.exp(row - row.max())
    q /= q.sum()
    assert 0 < q[3] < 0.3 and q[1] > 0.3 and q[2] > 0.3
    for p_min, kept in ((0.0, q), (0.3, np.where(q >= 0.3, q, 0.0) / q[[1, 2]].sum())):
        tree = proposer.propose([DraftRequest(f"r{p_min}", [3, 4, 5], 3, sampled,
                                              p_min=p_min)])[f"r{p_min}"]
        assert tree.q is not None and len(tree.q) == len(tree.tokens) == 3
        for drawn_from in tree.q:
            assert np.allclose(drawn_from, kept) and np.isclose(drawn_from.sum(), 1.0)

