"""Rows prepared side by side on worker threads draw what each request would draw alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from justllm.core.sampling_params import SamplingParams
from justllm.engine.row_sampling import RowJob, RowSampler, worth_a_worker
from justllm.engine.sampler import RequestSampler, SampledToken
from justllm.errors import EngineError

PARAMS = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.7, top_k=40, min_p=0.05),
          SamplingParams(temperature=0.9, repeat_penalty=1.3, presence_penalty=0.5),
          SamplingParams(temperature=0.0, logit_bias=((3, 50.0),)),
          SamplingParams(temperature=0.0, logprobs=3),
          SamplingParams(temperature=0.6, min_p=0.1, logprobs=2),
          SamplingParams(temperature=1.1, top_p=0.9, frequency_penalty=0.4, logprobs=0)]


def rows(n: int, vocab: int = 262_144) -> np.ndarray:
    rng = np.random.default_rng(7)
    return (rng.standard_normal((n, vocab)) * 2.0).astype(np.float32)


def test_parallel_rows_draw_exactly_what_each_sampler_draws_alone():
    logits = rows(8)
    alone = []
    for i in range(8):
        s = RequestSampler(PARAMS[i], seed=100 + i)
        alone.append([s.sample(logits[i], [1, 2, 3], [5, 6]) for _ in range(5)])
    pool = RowSampler(workers=3)
    samplers = [RequestSampler(PARAMS[i], seed=100 + i) for i in range(8)]
    together: list[list[SampledToken]] = [[] for _ in range(8)]
    try:
        for _ in range(5):
            got = pool.sample([RowJob(i, samplers[i], logits[i], [1, 2, 3], [5, 6])
                               for i in range(8)])
            assert sorted(got) == list(range(8))
            for i, token in got.items():
                assert isinstance(token, SampledToken)
                together[i].append(token)
        # the time it took, apart (benchmarks/engine_throughput.py reports both)
        assert pool.prepare_seconds > 0 and pool.draw_seconds > 0
    finally:
        pool.close()
    assert together == alone  # tokens, logprobs and top logprobs
    assert together[4] == [SampledToken(3)] * 5  # the bias decides the greedy row
    assert together[5][0].token_id == int(np.argmax(logits[5]))
    assert len(together[5][0].top_logprobs or ()) == 3


def test_rows_are_prepared_on_the_pool_drawn_here_and_an_error_ends_only_its_row():
    prepared: dict[str, str] = {}
    drawn: dict[str, str] = {}

    class Recording(RequestSampler):
        def __init__(self, name: str, *args, fail: str = "") -> None:
            super().__init__(*args)
            self.name, self.fail = name, fail

        def prepare(self, *args, **kwargs):
            prepared[self.name] = threading.current_thread().name
            if self.fail == "prepare":
                raise EngineError("bad row")
            return super().prepare(*args, **kwargs)

        def draw(self, *args, **kwargs):
            drawn[self.name] = threading.current_thread().name
            if self.fail == "draw":
                raise EngineError("no way forward")
            return super().draw(*args, **kwargs)

    logits = rows(6, 4096)
    pool = RowSampler(workers=2)
    jobs = [RowJob("a", Recording("a", PARAMS[0], 1), logits[0], [], []),
            RowJob("b", Recording("b", PARAMS[0], 2, fail="draw"), logits[1], [], []),
            RowJob("c", Recording("c", PARAMS[4], 3), logits[2], [], []),
            RowJob("d", Recording("d", PARAMS[0], 4, fail="prepare"), logits[3], [], []),
            *(RowJob(k, Recording(k, PARAMS[1], 5), logits[4 + i], [], [])
              for i, k in enumerate("ef"))]
    try:
        got = pool.sample(jobs)
    finally:
        pool.close()
    here = threading.current_thread().name
    assert isinstance(got["b"], EngineError) and str(got["b"]) == "no way forward"
    assert isinstance(got["d"], EngineError) and str(got["d"]) == "bad row"
    assert got["c"] == SampledToken(3)
    a = got["a"]
    assert isinstance(a, SampledToken) and 0 <= a.token_id < 4096
    # every other row on the pool's thread, from the second; every draw on this thread
    assert prepared["a"] == prepared["c"] == prepared["e"] == here
    assert prepared["b"].startswith("justllm-sampler")
    assert prepared["d"] == prepared["f"] == prepared["b"]
    assert drawn == dict.fromkeys("abcef", here)


def test_one_row_one_worker_or_little_work_stays_on_the_callers_thread():
    seen: list[str] = []

    class Recording(RequestSampler):
        def prepare(self, *args, **kwargs):
            seen.append(threading.current_thread().name)
            return super().prepare(*args, **kwargs)

    logits = rows(2, 4096)
    here = threading.current_thread().name
    for workers, n in ((4, 1), (1, 2)):
        pool = RowSampler(workers=workers)
        pool.sample([RowJob(i, Recording(PARAMS[0], i), logits[i], [], []) for i in range(n)])
        assert pool._pool is None
    assert seen == [here] * 3
    # eight greedy rows are not worth the hand-off (sixteen are)
    for n, shared in ((8, False), (16, True)):
        pool = RowSampler(workers=4)
        try:
            pool.sample([RowJob(i, Recording(PARAMS[4], i), logits[i % 2], [], [])
                         for i in range(n)])
            assert (pool._pool is not None) is shared
        finally:
            pool.close()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.8)])
def test_rows_without_a_grammar_go_to_a_worker(params):
    assert worth_a_worker(RequestSampler(params, 0))
    assert not worth_a_worker(RequestSampler(params, 0, constraint=object()))  # type: ignore[arg-type]


@pytest.mark.parametrize("gpu,llama_threads,cores,workers", [
    (False, 0, 2, 1),  # llama.cpp on every core: rows on the engine thread
    (False, 0, 16, 1),
    (False, 16, 16, 1),
    (False, 32, 16, 1),  # more threads than cores: none idle
    (False, 2, 16, 8),  # 14 idle cores and the engine thread's, at most 8
    (False, 4, 6, 3),
    (False, 1, 2, 2),
    (True, 0, 16, 8),  # the model on a GPU: every core idle between decodes
    (True, 0, 1, 1)])
def test_the_pool_takes_the_cores_llama_cpp_leaves_idle(gpu, llama_threads, cores, workers):
    from justllm.engine.row_sampling import sampling_workers

    assert sampling_workers(gpu, llama_threads, cores) == workers


def test_the_engine_draws_the_same_with_its_rows_prepared_on_a_pool(engine):
    """Sixteen requests at once (greedy and sampled, seeded, some with logprobs or penalties)
    come out the same, tokens and logprobs, whether the step's rows are prepared on three
    threads or all on the engine thread."""
    from tests.helpers import PROMPTS

    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95),
             dict(temperature=1.0, logprobs=2), dict(temperature=0.0, logprobs=1),
             dict(temperature=0.7, min_p=0.05, frequency_penalty=0.5)]

    def run() -> dict[int, tuple[list[int], list]]:
        engine.flush_prefix_cache()  # both runs compute every prompt alike
        ids = {engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True, seed=i,
                                                    **kinds[i % len(kinds)])): i
               for i, p in enumerate(PROMPTS)}
        got: dict[int, tuple[list[int], list]] = {i: ([], []) for i in ids.values()}
        done: set[str] = set()
        while len(done) < len(ids):
            for out in engine.step():
                assert out.error is None, out.error
                tokens, logprobs = got[ids[out.request_id]]
                tokens.extend(out.token_ids)
                logprobs.extend(out.logprobs or [])
                if out.finished:
                    done.add(out.request_id)
        return got

    original = engine.row_sampler
    try:
        engine.row_sampler = RowSampler(workers=1)
        alone = run()
        engine.row_sampler = RowSampler(workers=3)
        pooled = run()
        assert engine.row_sampler._pool is not None  # the rows did go to the pool
    finally:
        engine.row_sampler.close()
        engine.row_sampler = original
    assert pooled == alone
    assert all(len(tokens) == 10 for tokens, _ in alone.values())
