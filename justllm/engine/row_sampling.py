"""Choosing a step's tokens with the passes over whole rows side by side on worker threads.

Every row costs at least one pass over the whole 262k vocabulary: a greedy row's argmax (~70 µs
from memory here), a sampled row's first passes (its maximum, a compare that lists the near
tokens, two counts: engine/sampler.py). One after another on the engine thread, 64 greedy rows
are ~4.5 ms between two decodes, about as long as a GPU's decode of those rows. numpy releases
the GIL inside those passes, so they run in parallel: the engine thread takes one share of the
rows and the pool's threads the others (every n-th row, so greedy and sampled rows spread
evenly), each running :meth:`RequestSampler.prepare`. The draws themselves
(:meth:`RequestSampler.draw`: a few dozen small numpy calls on a few hundred candidates) stay on
the engine thread, one row after another: run on several threads they mostly wait for the GIL
and for each other (64 sampled rows on two threads took 1.1-1.4x as long as on one). A
request's generator is touched by the draw alone, so every request draws exactly what it would
have drawn alone, and seeds stay reproducible.

The pool only runs where cores are idle between decodes (:func:`sampling_workers`): with the
model on a GPU, where llama.cpp runs on fewer threads than there are cores, or where its
OpenMP threads sleep soon after a decode (engine/openmp.py: justllm shortens their spin as
llama.cpp loads, so that is every CPU build unless the user chose a wait policy of their own or
libgomp was loaded first). With libgomp's default spin they keep every core busy for
milliseconds after each decode and the workers would fight them for the cores.

Grammar-constrained rows stay on the engine thread: their matcher lives in llama.cpp, which the
engine calls from one thread only.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from justllm.config import usable_cpus
from justllm.engine.sampler import PreparedRow, RequestSampler, SampledToken
from justllm.errors import EngineError


@dataclass(frozen=True)
class RowJob:
    key: Hashable
    sampler: RequestSampler
    logits: np.ndarray
    prompt_ids: list[int]
    output_ids: list[int]


def sampling_workers(gpu: bool, llama_threads: int, cores: int | None = None,
                     cores_idle: bool = False) -> int:
    """Threads for the step's rows, the engine thread counted: its own core and the cores
    llama.cpp leaves idle between decodes (every core with the model on a GPU, or where its
    OpenMP threads sleep soon after a decode: ``cores_idle``, engine/openmp.py), at most 8; 1
    means the engine thread alone."""
    cores = cores or usable_cpus()
    if gpu or cores_idle:
        return max(1, min(cores, 8))
    idle = cores - min(llama_threads or cores, cores)
    return max(1, min(idle + 1, 8))  # the engine thread's own core and the idle ones


def worth_a_worker(sampler: RequestSampler) -> bool:
    """A row a worker may choose the token of: any without a grammar (module docstring)."""
    return sampler.constraint is None


class RowSampler:
    """The pool (started on first use, with ``workers - 1`` threads beside the caller's; 1:
    none, rows are sampled on the caller's thread)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        # Seconds spent preparing (every share, until the last is done) and drawing, over all
        # steps: what benchmarks/engine_throughput.py reports apart, since on a GPU the
        # whole-vocabulary passes and the draws are each a suspect.
        self.prepare_seconds = 0.0
        self.draw_seconds = 0.0

    def sample(self, jobs: Sequence[RowJob]) -> dict[Hashable, SampledToken | EngineError]:
        """Each job's token, or the EngineError its sampler raised (that request ends; the
        others go on). The rows are prepared in ``n`` shares (this thread takes every ``n``-th
        job from the first, the pool's threads the others; with one worker, or too little work
        to share, all on this thread), then drawn here in order."""
        t0 = time.perf_counter()
        shares = min(self.workers, len(jobs)) if _worth_sharing(jobs) else 1
        if shares < 2:
            prepared = _prepare_all(jobs)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers - 1,
                                                thread_name_prefix="justllm-sampler")
            pool = self._pool
            others = [pool.submit(_prepare_all, jobs[i::shares]) for i in range(1, shares)]
            prepared = _prepare_all(jobs[::shares])
            for future in others:
                prepared.update(future.result())
        t1 = time.perf_counter()
        drawn = {job.key: _draw(job, prepared[job.key]) for job in jobs}
        self.prepare_seconds += t1 - t0
        self.draw_seconds += time.perf_counter() - t1
        return drawn

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


# Handing shares to the pool costs about 0.1 ms a step; an argmax is ~55-70 µs, preparing a
# sampled row ~160 µs. Below 16 argmaxes' worth the hand-off costs more than it saves (8 greedy
# rows with llama.cpp on one of two cores: 0.44 ms a step on the engine thread, 0.54 in two
# shares; 32: 1.46 against 1.38; 8 sampled rows: 2.40 against 2.10).
_MIN_SHARED_WORK = 16
_SAMPLED_ROW_WORK = 3


def _worth_sharing(jobs: Sequence[RowJob]) -> bool:
    work = sum(1 if job.sampler.params.greedy else _SAMPLED_ROW_WORK for job in jobs)
    return work >= _MIN_SHARED_WORK


def _prepare_all(jobs: Sequence[RowJob]) -> dict[Hashable, PreparedRow | EngineError]:
    got: dict[Hashable, PreparedRow | EngineError] = {}
    for job in jobs:
        try:
            got[job.key] = job.sampler.prepare(job.logits, job.prompt_ids, job.output_ids)
        except EngineError as e:
            got[job.key] = e
    return got


def _draw(job: RowJob, row: PreparedRow | EngineError) -> SampledToken | EngineError:
    if isinstance(row, EngineError):
        return row
    try:
        return job.sampler.draw(row)
    except EngineError as e:
        return e
