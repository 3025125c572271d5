"""Speculative chunks in the pure scheduler: budgets, blocks, tree sequences, settle, undo."""

import numpy as np

from justllm.core.plan import DraftTree
from justllm.core.request import FinishReason
from justllm.core.scheduler import Scheduler, SchedulerConfig
from justllm.kv.block_pool import BlockPool
from justllm.kv.radix_cache import KVOp
from tests.core.test_scheduler import make_req, run_step


def sched(pool_blocks=64, block_size=4, **kw) -> Scheduler:
    kw.setdefault("n_seq_ids", kw.get("max_seqs", 4) + 4)
    kw.setdefault("max_seqs", 4)
    return Scheduler(SchedulerConfig(**kw), BlockPool(pool_blocks, block_size))


def decoding(s: Scheduler, n_prompt=6):
    r = make_req(0, n_prompt)
    s.add(r)
    run_step(s)  # prefill + first token
    assert r.num_uncomputed_tokens == 1
    return r


def test_draft_chain_rides_the_decode_and_gets_blocks():
    s = sched()
    r = decoding(s)  # 6 prompt + 1 output = 7 tokens, 2 blocks of 4
    plan = s.schedule({"r0": DraftTree.chain([11, 12, 13])})
    (c,) = plan.chunks
    assert c.start == 6 and c.token_ids == [7, 11, 12, 13] and c.num_logits == 4
    assert c.is_decode and c.leaf_seqs == ()
    assert len(r.block_ids) == 3  # 7 tokens + 3 draft cells = 10 cells
    s.update(plan)
    assert r.num_computed_tokens == 7  # only the root is known good
    r.output_token_ids += [11, 12, 99]  # two drafts accepted, then the model's own token
    s.settle(c, [0, 1])
    assert r.num_computed_tokens == 9 and r.num_uncomputed_tokens == 1
    assert s._pending_ops[-1] == KVOp.rm(r.seq_id, 9, -1)
    assert len(r.block_ids) == 3  # 10 tokens still need 3 blocks


def test_rejected_drafts_give_their_blocks_back():
    s = sched()
    r = decoding(s)
    plan = s.schedule({"r0": DraftTree.chain([11, 12, 13, 14, 15, 16])})
    assert len(r.block_ids) == 4  # 7 + 6 cells
    s.update(plan)
    r.output_token_ids.append(50)  # first draft rejected
    s.settle(plan.chunks[0], [])
    assert r.num_computed_tokens == 7 and len(r.block_ids) == 2
    assert s.pool.num_free == 62


def test_draft_is_cut_to_the_token_and_output_budgets():
    s = sched(n_batch=8, chunk_size=8, max_prefill=1, max_outputs=6)
    r = decoding(s)
    c = s.schedule({"r0": DraftTree.chain(list(range(10, 20)))}).chunks[0]
    # outputs: 6 rows - 1 decode - 1 reserved for a prefill = 4 draft rows
    assert c.token_ids == [7, 10, 11, 12, 13]
    assert r.request_id == "r0"


def test_draft_is_cut_to_free_blocks_and_never_preempts():
    s = sched(pool_blocks=4, max_seqs=2)
    r = decoding(s)
    other = make_req(1, 2)
    s.add(other)
    run_step(s)  # r decodes (8 tokens, 2 blocks), other is prefilled (3 tokens, 1 block)
    assert s.pool.num_free == 1
    plan = s.schedule({"r0": DraftTree.chain([11, 12, 13, 14, 15])})
    chunk = next(c for c in plan.chunks if c.request is r)
    assert chunk.token_ids == [7, 11, 12, 13, 14]  # the last free block holds 4 draft cells
    assert not plan.preempted and s.pool.num_free == 0
    assert any(c.request is other for c in plan.chunks)  # other still decodes


def test_tree_leaves_get_their_own_sequences_and_the_winner_is_copied_back():
    s = sched()
    r = decoding(s)
    main = r.seq_id
    tree = DraftTree((11, 21, 12, 22), (-1, -1, 0, 1))  # two branches of two
    assert tree.leaves == (2, 3) and tree.node_leaves == ((0,), (1,), (0,), (1,))
    plan = s.schedule({"r0": tree})
    (c,) = plan.chunks
    assert len(c.leaf_seqs) == 1 and c.leaf_seqs[0] != main
    leaf = c.leaf_seqs[0]
    assert KVOp.cp(main, leaf, 0, 6) in plan.kv_ops  # the leaf sees the prefix
    s.update(plan)
    r.output_token_ids += [21, 22, 5]  # the second branch was right
    s.settle(c, [1, 3])
    ops = s._pending_ops
    assert ops[-3:] == [KVOp.rm(main, 7, -1), KVOp.cp(leaf, main, 7, 9), KVOp.rm(leaf)]
    assert r.num_computed_tokens == 9
    assert leaf in s._free_seq_ids


def test_tree_falls_back_to_its_first_branch_without_free_sequence_ids():
    s = sched(n_seq_ids=4, max_seqs=4)
    decoding(s)
    for i in range(1, 4):
        s.add(make_req(i, 2))
    run_step(s)
    assert not s._free_seq_ids
    c = s.schedule({"r0": DraftTree((11, 21, 12, 22), (-1, -1, 0, 1))}).chunks[0]
    assert c.token_ids == [7, 11, 12] and c.leaf_seqs == () and c.draft.is_chain


def test_abort_during_a_speculative_step_still_frees_the_tree_sequences():
    s = sched()
    r = decoding(s)
    plan = s.schedule({"r0": DraftTree((11, 21), (-1, -1))})
    leaf = plan.chunks[0].leaf_seqs[0]
    s.abort("r0")  # from another thread while the batch runs
    s.update(plan)
    s.settle(plan.chunks[0], [])
    assert r.finish_reason is FinishReason.ABORT and leaf in s._free_seq_ids
    assert KVOp.rm(leaf) in s._pending_ops and s.pool.num_free == 64


def test_undo_drops_what_a_failed_batch_may_have_written():
    s = sched()
    r = decoding(s)
    plan = s.schedule({"r0": DraftTree((11, 21), (-1, -1))})
    leaf = plan.chunks[0].leaf_seqs[0]
    s.undo(plan)
    assert s._pending_ops[-2:] == [KVOp.rm(r.seq_id, 6, -1), KVOp.rm(leaf)]
    assert r.num_computed_tokens == 6 and len(r.block_ids) == 2
    again = s.schedule()
    assert again.chunks[0].start == 6 and again.chunks[0].token_ids == [7]


def test_spare_draft_tokens_fill_the_last_group_of_output_rows():
    s = sched(row_multiple=4)
    r = decoding(s)
    # the window wants 1 draft token (2 rows); the proposer offered 6: 2 more fill the group
    c = s.schedule({"r0": DraftTree.chain([11, 12, 13, 14, 15, 16], wanted=1)}).chunks[0]
    assert c.token_ids == [7, 11, 12, 13]
    s2 = sched(row_multiple=1)
    r2 = decoding(s2)
    c2 = s2.schedule({"r0": DraftTree.chain([11, 12, 13, 14, 15, 16], wanted=1)}).chunks[0]
    assert c2.token_ids == [7, 11] and r.request_id == r2.request_id


def test_a_step_one_row_into_a_new_group_drops_a_draft_token():
    s = sched(row_multiple=4)
    r = decoding(s)
    c = s.schedule({"r0": DraftTree.chain([11, 12, 13, 14])}).chunks[0]  # 5 rows
    assert c.token_ids == [7, 11, 12, 13] and len(c.draft) == 3
    assert len(r.block_ids) == 3  # 7 tokens + 3 draft cells


class FakeBackend:
    """The runner's view of a backend: batch arrays, and a decode that returns one row per
    flagged token holding that token's batch index."""

    def __init__(self, n=64):
        self.batch_tokens = np.zeros(n, np.int32)
        self.batch_pos = np.zeros(n, np.int32)
        self.batch_seqs = np.zeros((n, 4), np.int32)
        self.batch_seq = self.batch_seqs[:, 0]
        self.batch_n_seq = np.ones(n, np.int32)
        self.batch_logits = np.zeros(n, np.int8)
        self.flags_seen = None

    def decode(self, n, split=0):
        self.flags_seen = self.batch_logits[:n].copy()
        return np.flatnonzero(self.batch_logits[:n]).astype(np.float32)[:, None]

    def seq_rm(self, *a):
        pass

    def seq_cp(self, *a):
        pass


def test_runner_pads_logits_rows_with_prompt_tokens_and_returns_only_the_wanted():
    from justllm.core.plan import ScheduledChunk, StepPlan
    from justllm.engine.runner import Runner

    reqs = [make_req(i, 8) for i in range(3)]
    for i, r in enumerate(reqs):
        r.seq_id = i
    plan = StepPlan(chunks=[ScheduledChunk(reqs[0], 0, list(range(1, 9)), True),
                            ScheduledChunk(reqs[1], 8, [5], True),
                            ScheduledChunk(reqs[2], 8, [6], True)], pad_rows=1)
    b = FakeBackend()
    out = Runner(b).execute(plan)
    assert out[:, 0].tolist() == [7, 8, 9]  # the three rows asked for, in plan order
    assert int(b.flags_seen.sum()) == 4  # one prompt token padded the group
    assert b.flags_seen[6] == 1  # the last prompt token that needed no logits
    plain = FakeBackend()
    plan.pad_rows = 0
    Runner(plain).execute(plan)
    assert int(plain.flags_seen.sum()) == 3


def test_the_scheduler_decides_the_padding_rows():
    s = sched(row_multiple=4, chunk_size=16, n_batch=64)
    decoders = [make_req(i, 2) for i in range(3)]
    for r in decoders:
        s.add(r)
    run_step(s)  # three prompts, three rows
    s.add(make_req(9, 30))
    plan = s.schedule()  # 3 decode rows + a 16-token prompt chunk with no row
    assert plan.num_logits == 3 and plan.pad_rows == 1
    s.update(plan)
    s2 = sched(row_multiple=1)
    s2.add(make_req(0, 2))
    s2.add(make_req(1, 2))
    assert s2.schedule().pad_rows == 0


def test_decodes_beside_a_long_enough_prompt_chunk_are_split_off():
    """split_decodes_at: the decodes (drafts included) go in a llama_decode of their own when
    the step holds a prompt chunk too and reaches the threshold; the rows are then padded
    per llama_decode, and the decodes have no prompt tokens to pad with."""
    def step_with_prompt(prompt: int, **kw):
        s = sched(max_seqs=8, chunk_size=64, n_batch=128, **kw)
        decoders = [make_req(i, 2) for i in range(3)]
        for r in decoders:
            s.add(r)
        run_step(s)  # three prompts, then three decodes
        s.add(make_req(9, prompt))
        return s.schedule({"r0": DraftTree.chain([11, 12])})

    plan = step_with_prompt(61, split_decodes_at=64)  # 3 decodes, 2 drafts, 61 prompt tokens
    assert [len(c.token_ids) for c in plan.chunks] == [3, 1, 1, 61] and plan.split == 5
    assert plan.num_tokens == 66
    assert step_with_prompt(58, split_decodes_at=64).split == 0  # 63 tokens: one batch
    assert step_with_prompt(61).split == 0  # off
    assert step_with_prompt(61, split_decodes_at=4).split == 0  # the decodes reach it alone
    # A prompt chunk with a row on every token (prompt logprobs) pads its own group of 4.
    s = sched(max_seqs=8, chunk_size=64, n_batch=128, row_multiple=4, split_decodes_at=64)
    for r in (make_req(0, 2), make_req(1, 2)):
        s.add(r)
    run_step(s)
    s.add(make_req(9, 70))
    plan = s.schedule()
    assert [len(c.token_ids) for c in plan.chunks] == [1, 1, 64] and plan.split == 2
    assert plan.num_logits == 2 and plan.pad_rows == 0  # the chunk asks for no row
    mixed = sched(max_seqs=8, chunk_size=64, n_batch=128, row_multiple=4)
    for r in (make_req(0, 2), make_req(1, 2)):
        mixed.add(r)
    run_step(mixed)
    mixed.add(make_req(9, 70))
    assert mixed.schedule().pad_rows == 2  # unsplit, the prompt's tokens fill the group


def test_a_single_draft_token_is_never_dropped_for_the_row_group():
    s = sched(row_multiple=4, max_seqs=8, n_seq_ids=12)
    reqs = [make_req(i, 3) for i in range(8)]
    for r in reqs:
        s.add(r)
    run_step(s)
    run_step(s)  # 8 decodes from now on
    plan = s.schedule({"r0": DraftTree.chain([11])})  # 9 rows: one into a new group
    assert plan.chunks[0].token_ids[1:] == [11] and plan.num_logits == 9


def test_a_prompt_for_its_logprobs_goes_on_while_drafts_take_every_spare_row():
    """Drafts take the step's rows but those kept for prefill slots; a prompt that wants its
    logprobs (a row per token) still gets its own slot's row each step, never none."""
    from justllm.core.request import Request
    from justllm.core.sampling_params import SamplingParams

    s = sched(n_batch=64, chunk_size=32, max_prefill=2, max_outputs=12, max_seqs=4)
    decoders = [make_req(i, 6) for i in range(3)]
    for r in decoders:
        s.add(r)
    run_step(s)
    run_step(s)  # two prefill slots: the third decoder's prompt in the second step
    assert all(r.num_uncomputed_tokens == 1 for r in decoders)
    wants = Request("w", list(range(1, 21)), SamplingParams(max_tokens=2, prompt_logprobs=0),
                    arrival=9, max_total_tokens=22)
    s.add(wants)
    for _ in range(20):
        drafts = {r.request_id: DraftTree.chain(list(range(30, 40))) for r in decoders}
        plan = s.schedule(drafts)
        assert plan.num_logits <= 12
        got = [c for c in plan.chunks if c.request is wants]
        assert got and got[0].num_logits >= 1
        s.update(plan)
        for c in plan.chunks:
            if c.draft is not None:
                c.request.output_token_ids.append(7)
                s.settle(c, [])
            elif c.wants_logits:
                c.request.output_token_ids.append(7)
        if wants.num_uncomputed_tokens <= 1:
            break
    assert wants.num_computed_tokens == 19  # all but the last token: a row or more a step
