"""A model of llama.cpp's unified KV cache for pure tests: cells tagged with sequence ids.

It keeps what the scheduler's correctness rests on (docs/llama-cpp-facts.md): ``seq_cp`` tags the same
cells with another id, ``seq_rm`` untags and frees a cell no id uses, a batch token must follow
its sequence's last position, and a batch that does not fit is refused whole.
"""

from __future__ import annotations

from justllm.core.plan import StepPlan
from justllm.kv.radix_cache import KVOp, KVOpKind


class PositionError(Exception):
    """What llama_decode reports as "inconsistent sequence positions"."""


class FakeKV:
    def __init__(self, n_cells: int) -> None:
        self.n_cells = n_cells
        self.cells: dict[int, tuple[int, set[int]]] = {}  # cell id -> (pos, seq ids)
        self._next = 0

    def apply(self, ops: list[KVOp]) -> None:
        for op in ops:
            lo, hi = max(op.p0, 0), (op.p1 if op.p1 >= 0 else 1 << 30)
            for cell, (pos, seqs) in list(self.cells.items()):
                if not lo <= pos < hi:
                    continue
                if op.kind is KVOpKind.RM:
                    seqs.discard(op.seq)
                    if not seqs:
                        del self.cells[cell]
                elif op.src in seqs:
                    seqs.add(op.seq)

    def positions(self, seq: int) -> list[int]:
        return sorted(pos for pos, seqs in self.cells.values() if seq in seqs)

    def decode(self, plan: StepPlan) -> None:
        """One batch: every chunk's tokens follow on from its sequence's last position."""
        if len(self.cells) + plan.num_tokens > self.n_cells:
            raise MemoryError("KV full")
        for chunk in plan.chunks:
            seq = chunk.request.seq_id
            have = self.positions(seq)
            last = have[-1] if have else -1
            if chunk.start != last + 1:
                raise PositionError(f"sequence {seq}: last position {last}, batch starts at "
                                    f"{chunk.start}")
            for pos in range(chunk.start, chunk.start + len(chunk.token_ids)):
                self.cells[self._next] = (pos, {seq})
                self._next += 1

    # KVProbe
    def seq_pos_min(self, seq: int) -> int:
        p = self.positions(seq)
        return p[0] if p else -1

    def seq_pos_max(self, seq: int) -> int:
        p = self.positions(seq)
        return p[-1] if p else -1

    def seq_num_cells(self, seq: int) -> int:
        return len(self.positions(seq))
