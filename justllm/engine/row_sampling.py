"""Sampling a step's rows side by side on worker threads.

A sampled (temperature > 0) row costs about half a millisecond on a 262k vocabulary (two
full-row passes, engine/sampler.py), and the engine thread does them one after another between
two decodes. numpy releases the GIL inside those passes, so the rows of one step can run in
parallel on a small pool, one row per task: each request's sampler (its random generator, its
penalties) is touched by one task only, so every request draws exactly what it would have drawn
alone, and seeds stay reproducible.

The pool only pays where cores are idle between decodes (:func:`sampling_workers`): with the
model on a GPU, or when llama.cpp runs on fewer threads than there are cores. On a CPU build
using every core it costs more than it gives: llama.cpp's OpenMP threads spin for a while after
each decode, and the workers fight them for the cores (2 cores, 8 rows at temperature 0.8: 6.5
ms a step on two workers, 5.4 ms on the engine thread alone).

Greedy rows (an argmax) are not worth a hand-off, and grammar-constrained rows stay on the engine
thread: their matcher lives in llama.cpp, which the engine calls from one thread only.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from justllm.config import usable_cpus
from justllm.engine.sampler import RequestSampler, SampledToken
from justllm.errors import EngineError


@dataclass(frozen=True)
class RowJob:
    key: Hashable
    sampler: RequestSampler
    logits: np.ndarray
    prompt_ids: list[int]
    output_ids: list[int]


def sampling_workers(gpu: bool, llama_threads: int, cores: int | None = None) -> int:
    """Threads for the step's sampled rows: the cores llama.cpp leaves idle between decodes
    (all of them with the model on a GPU), at most 8; 1 means on the engine thread."""
    cores = cores or usable_cpus()
    idle = cores if gpu else cores - (llama_threads or cores)
    return max(1, min(idle, 8))


def worth_a_worker(sampler: RequestSampler) -> bool:
    """A row that costs more than a hand-off and that a worker may sample (module docstring)."""
    return not sampler.params.greedy and sampler.constraint is None


class RowSampler:
    """The pool (started on first use, with ``workers`` threads; 1: none, rows are sampled on
    the caller's thread)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
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
