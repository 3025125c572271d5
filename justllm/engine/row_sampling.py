"""Sampling a step's rows side by side on worker threads.

A sampled (temperature > 0) row costs about a millisecond on a 262k vocabulary -- a float32 exp
and a nucleus over every logit -- and the engine thread used to do them one after another while
llama.cpp's threads sat idle between two decodes. numpy releases the GIL inside those passes,
so the rows of one step run in parallel on a small pool, one row per task: each request's
sampler (its random generator, its penalties) is touched by one task only, so every request
draws exactly what it would have drawn alone, and seeds stay reproducible.

Greedy rows (an argmax) are not worth a hand-off, and grammar-constrained rows stay on the engine
thread: their matcher lives in llama.cpp, which the engine calls from one thread only.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from justllm.engine.sampler import RequestSampler, SampledToken
from justllm.errors import EngineError


@dataclass(frozen=True)
class RowJob:
    key: Hashable
    sampler: RequestSampler
    logits: np.ndarray
    prompt_ids: list[int]
    output_ids: list[int]


def worth_a_worker(sampler: RequestSampler) -> bool:
    """A row that costs more than a hand-off and that a worker may sample (module docstring)."""
    return not sampler.params.greedy and sampler.constraint is None


class RowSampler:
    """The pool (started on first use, ``workers`` threads; 0: one per core, at most 8)."""

    def __init__(self, workers: int = 0) -> None:
        self.workers = workers or min(os.cpu_count() or 1, 8)
        self._pool: ThreadPoolExecutor | None = None

    def sample(self, jobs: Sequence[RowJob]) -> dict[Hashable, SampledToken | EngineError]:
        """Each job's token, or the EngineError its sampler raised (that request ends; the
        others go on). With one job or one worker, on this thread."""
        if len(jobs) < 2 or self.workers < 2:
            return dict(_run(job) for job in jobs)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="justllm-sampler")
        return dict(self._pool.map(_run, jobs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _run(job: RowJob) -> tuple[Hashable, SampledToken | EngineError]:
    try:
        return job.key, job.sampler.sample(job.logits, job.prompt_ids, job.output_ids)
    except EngineError as e:
        return job.key, e
