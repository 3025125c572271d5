"""What the KV cache must hold, as the scheduler sees it, and a check against what it holds.

Every sequence id in use is accounted for by exactly one owner: a running request holds the
positions ``0 .. num_computed_tokens`` of its own tokens (plus nothing else), the extra leaves of
a speculative tree hold a copy of their request's prefix, a prefix-cache holder holds exactly the
positions of the tree nodes it holds, and a free sequence id holds nothing. The engine compares
this with llama.cpp's own view of each sequence after every step when its KV check is on (the
tests turn it on): a scheduler that believes a sequence holds cells llama.cpp does not have makes
``llama_decode`` fail for the whole batch, and a cell llama.cpp keeps that nobody accounts for is a
leak. Both are caught at the step that causes them instead of minutes later, as is a KV block the
pool counts as used that neither a running request nor the prefix cache holds.

Pure: the observed side comes in through :class:`KVProbe`, so the check runs with no model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from justllm.core.request import RequestStatus
from justllm.core.scheduler import Scheduler


class KVProbe(Protocol):
    """llama.cpp's view of one sequence: lowest and highest position (-1 when it holds none)
    and, where the backend can count them, how many cells it holds (None: unknown)."""

    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...
    def seq_num_cells(self, seq_id: int) -> int | None: ...


def merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-empty, non-overlapping half-open ranges covering the same positions."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def expected_kv(scheduler: Scheduler) -> dict[int, list[tuple[int, int]]]:
    """Sequence id -> the positions it must hold, for every id that must hold something.

    Valid between steps, once the pending KV operations have been applied (the engine checks
    right after the runner applied them and before it decodes the batch)."""
    want: dict[int, list[tuple[int, int]]] = {}
    for req in scheduler.running:
        if req.seq_id is not None and req.status is RequestStatus.RUNNING:
            want.setdefault(req.seq_id, []).append((0, req.num_computed_tokens))
    if scheduler.cache is not None:
        for seq, ranges in scheduler.cache.held_ranges().items():
            if seq in want:
                raise AssertionError(f"sequence {seq} is both a running request and a holder")
            want[seq] = list(ranges)
    return {seq: merge(r) for seq, r in want.items() if merge(r)}


def kv_mismatches(scheduler: Scheduler, probe: KVProbe, n_seq_ids: int,
                  skip: Iterable[int] = ()) -> list[str]:
    """Every sequence id whose cells differ from what the scheduler expects, in words.

    ``skip``: ids another owner accounts for (a speculative step's tree leaves)."""
    want = expected_kv(scheduler)
    skipped = set(skip)
    problems = scheduler.cache.check() if scheduler.cache is not None else []
    problems += block_mismatches(scheduler)
    if scheduler.cache is not None:
        for seq, ranges in scheduler.cache.live_ranges().items():
            end = max(b for _, b in ranges)
            if end > sum(b - a for a, b in want.get(seq, [])):
                problems.append(f"live prefix-cache nodes of sequence {seq} reach position "
                                f"{end - 1}, past what its running request has computed")
    for seq in range(n_seq_ids):
        if seq in skipped:
            continue
        ranges = want.get(seq, [])
        lo, hi = (ranges[0][0], ranges[-1][1] - 1) if ranges else (-1, -1)
        got_lo, got_hi = probe.seq_pos_min(seq), probe.seq_pos_max(seq)
        n_want = sum(b - a for a, b in ranges)
        n_got = probe.seq_num_cells(seq)
        if (got_lo, got_hi) != (lo, hi) or (n_got is not None and n_got != n_want):
            problems.append(
                f"sequence {seq}: expected positions {_fmt(ranges)} ({n_want} cells), "
                f"llama.cpp holds {got_lo}..{got_hi}"
                + (f" ({n_got} cells)" if n_got is not None else ""))
    return problems


def block_mismatches(scheduler: Scheduler) -> list[str]:
    """The pool's used blocks must be exactly the running requests' and the prefix cache's:
    one held by nobody is never freed (the KV pool shrinks for good), in words."""
    pool, cache = scheduler.pool, scheduler.cache
    problems = [f"waiting request {r.request_id} holds {len(r.block_ids)} KV blocks"
                for r in scheduler.waiting if r.block_ids]
    held = sum(len(r.block_ids) for r in scheduler.running)
    held += cache.num_blocks if cache is not None else 0
    used = pool.usage().used
    if used != held:
        problems.append(f"{used} KV blocks used, {held} held by the running requests and the "
                        "prefix cache")
    return problems


def _fmt(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}..{b - 1}" for a, b in ranges) or "none"
