"""Sampled rows side by side on worker threads draw what each request would draw alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from justllm.core.sampling_params import SamplingParams
from justllm.engine.row_sampling import RowJob, RowSampler, worth_a_worker
from justllm.engine.sampler import RequestSampler
from justllm.errors import EngineError

PARAMS = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.7, top_k=40, min_p=0.05),
          SamplingParams(temperature=0.9, repeat_penalty=1.3, presence_penalty=0.5)]


def rows(n: int, vocab: int = 262_144) -> np.ndarray:
    rng = np.random.default_rng(7)
    return (rng.standard_normal((n, vocab)) * 2.0).astype(np.float32)


def test_parallel_rows_draw_exactly_what_each_sampler_draws_alone():
    logits = rows(8)
    alone = []
    for i in range(8):
        s = RequestSampler(PARAMS[i % 4], seed=100 + i)
        alone.append([s.sample(logits[i], [1, 2, 3], [5, 6]).token_id for _ in range(5)])
    pool = RowSampler(workers=3)
    samplers = [RequestSampler(PARAMS[i % 4], seed=100 + i) for i in range(8)]
    together: list[list[int]] = [[] for _ in range(8)]
    try:
        for _ in range(5):
            got = pool.sample([RowJob(i, samplers[i], logits[i], [1, 2, 3], [5, 6])
                               for i in range(8)])
            assert sorted(got) == list(range(8))
            for i, token in got.items():
                together[i].append(token.token_id)
    finally:
        pool.close()
    assert together == alone


def test_rows_run_on_the_pool_and_an_error_ends_only_its_row():
    threads: set[str] = set()

    class Failing(RequestSampler):
        def sample(self, *args, **kwargs):
            threads.add(threading.current_thread().name)
            raise EngineError("no way forward")

    class Recording(RequestSampler):
        def sample(self, *args, **kwargs):
            threads.add(threading.current_thread().name)
            return super().sample(*args, **kwargs)

    logits = rows(3, 4096)
    pool = RowSampler(workers=2)
    try:
        got = pool.sample([RowJob("a", Recording(PARAMS[0], 1), logits[0], [], []),
                           RowJob("b", Failing(PARAMS[0], 2), logits[1], [], []),
                           RowJob("c", Recording(PARAMS[0], 3), logits[2], [], [])])
    finally:
        pool.close()
    assert isinstance(got["b"], EngineError) and str(got["b"]) == "no way forward"
    assert 0 <= got["a"].token_id < 4096 and 0 <= got["c"].token_id < 4096
    assert threads and all(t.startswith("justllm-sampler") for t in threads)


def test_one_row_or_one_worker_stays_on_the_callers_thread():
    seen: list[str] = []

    class Recording(RequestSampler):
        def sample(self, *args, **kwargs):
            seen.append(threading.current_thread().name)
            return super().sample(*args, **kwargs)

    logits = rows(2, 4096)
    here = threading.current_thread().name
    for workers, n in ((4, 1), (1, 2)):
        pool = RowSampler(workers=workers)
        pool.sample([RowJob(i, Recording(PARAMS[0], i), logits[i], [], []) for i in range(n)])
        assert pool._pool is None
    assert seen == [here] * 3


@pytest.mark.parametrize("params,worth", [
    (SamplingParams(temperature=0.0), False), (SamplingParams(temperature=0.8), True)])
def test_only_sampled_rows_without_a_grammar_go_to_a_worker(params, worth):
    assert worth_a_worker(RequestSampler(params, 0)) is worth
    assert not worth_a_worker(RequestSampler(params, 0, constraint=object()))  # type: ignore[arg-type]


@pytest.mark.parametrize("gpu,llama_threads,cores,workers", [
    (False, 0, 2, 1),  # llama.cpp on every core: rows on the engine thread
    (False, 0, 16, 1),
    (False, 2, 16, 8),  # 14 idle cores, at most 8
    (False, 4, 6, 2),
    (True, 0, 16, 8),  # the model on a GPU: every core idle between decodes
    (True, 0, 1, 1)])
def test_the_pool_takes_the_cores_llama_cpp_leaves_idle(gpu, llama_threads, cores, workers):
    from justllm.engine.row_sampling import sampling_workers

    assert sampling_workers(gpu, llama_threads, cores) == workers
