"""Executes a StepPlan on the backend: drop released KV, fill one batch, decode."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from justllm.core.plan import ScheduledChunk, StepPlan
from justllm.kv.radix_cache import KVOp, KVOpKind


class Backend(Protocol):
    """What the runner needs of a backend (``LlamaBackend``, or a fake in pure tests)."""

    batch_tokens: np.ndarray
    batch_pos: np.ndarray
    batch_seq: np.ndarray
    batch_seqs: np.ndarray
    batch_n_seq: np.ndarray
    batch_logits: np.ndarray

    def decode(self, n_tokens: int, split: int = 0) -> np.ndarray: ...
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None: ...
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...


class Runner:
    """Applies a plan. ``plan.pad_rows`` (the scheduler's decision) asks for logits of that many
    prompt tokens that need none, the last ones in the batch, and leaves them out of what
    ``decode`` returns."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._keep: np.ndarray | None = None  # rows to return when padding was added
        self._split = 0  # the plan's split: its decodes' tokens, decoded on their own

    def apply_kv_ops(self, ops: list[KVOp]) -> None:
        b = self.backend
        for op in ops:
            if op.kind is KVOpKind.RM:
                b.seq_rm(op.seq, op.p0, op.p1)
            else:
                b.seq_cp(op.src, op.seq, op.p0, op.p1)

    def execute(self, plan: StepPlan) -> np.ndarray:
        """Compute the plan's chunks in one ``llama_decode`` (two with ``plan.split``).

        Returns ``chunk.num_logits`` rows per chunk, in plan order (a view valid until the
        next step): one for a chunk that wants logits, one per token of a speculative chunk.
        """
        return self.decode(self.prepare(plan))

    def prepare(self, plan: StepPlan) -> int:
        """Apply the plan's KV operations and fill the batch; returns its number of tokens.
        The engine calls this under its lock, so no request changes (an abort) half-way."""
        self.apply_kv_ops(plan.kv_ops)
        b = self.backend
        o = 0
        for chunk in plan.chunks:
            n = len(chunk.token_ids)
            end = o + n
            b.batch_tokens[o:end] = chunk.token_ids
            b.batch_n_seq[o:end] = 1
            if chunk.draft is None or chunk.draft.is_chain:
                b.batch_pos[o:end] = np.arange(chunk.start, chunk.start + n, dtype=np.int32)
                b.batch_seq[o:end] = chunk.request.seq_id
                # a draft, or a prompt's logprobs: every row
                b.batch_logits[o:end] = chunk.draft is not None or chunk.all_logits
                b.batch_logits[end - 1] = chunk.wants_logits or chunk.all_logits
            else:
                self._fill_tree(chunk, o)
            o = end
        self._keep = self._pad_rows(o, plan.pad_rows) if plan.pad_rows else None
        self._split = plan.split
        return o

    def decode(self, n_tokens: int) -> np.ndarray:
        if not n_tokens:
            return np.empty((0, 0), dtype=np.float32)
        logits = self.backend.decode(n_tokens, self._split)
        return logits if self._keep is None else logits[self._keep]

    def _pad_rows(self, n: int, pad: int) -> np.ndarray:
        flags = self.backend.batch_logits[:n]
        added = np.flatnonzero(flags == 0)[-pad:]
        flags[added] = 1
        return np.flatnonzero(~np.isin(np.flatnonzero(flags), added))

    def _fill_tree(self, chunk: ScheduledChunk, o: int) -> None:
        """The root and the tree's nodes, logits on every row. Each node belongs to the
        sequences of the leaves below it, so every leaf sees exactly its own path."""
        b, draft = self.backend, chunk.draft
        assert draft is not None
        b.batch_logits[o:o + len(draft) + 1] = 1
        seqs = (chunk.request.seq_id,) + chunk.leaf_seqs
        b.batch_pos[o] = chunk.start
        b.batch_seqs[o, :len(seqs)] = seqs
        b.batch_n_seq[o] = len(seqs)
        for i, (depth, leaves) in enumerate(zip(draft.depths, draft.node_leaves), start=o + 1):
            b.batch_pos[i] = chunk.start + depth
            b.batch_seqs[i, :len(leaves)] = [seqs[j] for j in leaves]
            b.batch_n_seq[i] = len(leaves)
