"""AsyncEngine: the step loop on its own thread, outputs through ``async for``."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.async_engine import AsyncEngine
from justllm.engine.engine import Engine
from justllm.errors import InvalidRequestError


@pytest.fixture(scope="module")
def aengine(model_path):
    a = AsyncEngine(Engine(EngineConfig(model=model_path, max_seqs=8, pool_blocks=256)))
    yield a
    a.close()


async def collect(a: AsyncEngine, prompt: str, params: SamplingParams):
    text, tokens, last = "", [], None
    async for out in a.generate(prompt, params):
        text += out.text
        tokens += out.token_ids
        last = out
    return text, tokens, last


def test_concurrent_streams_complete(aengine):
    async def main():
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        return await asyncio.gather(*[collect(aengine, f"Number {i} is", params) for i in range(8)])

    results = asyncio.run(main())
    assert all(len(tokens) == 10 and last.finish_reason == "length" for _, tokens, last in results)
    assert all(last.metrics.ttft is not None and last.metrics.ttft > 0 for _, _, last in results)


def request_blocks(eng) -> int:
    """Blocks held by requests (the rest are the prefix cache's)."""
    s = eng.stats()
    return s.kv_blocks.used - s.prefix_cache.blocks


async def kv_cells_released(eng) -> bool:
    """Once the cache is flushed, the engine thread drops every cell at its next step (bounded
    wait; a loaded machine makes steps slow, so the bound is generous)."""
    eng.flush_prefix_cache()
    for _ in range(600):
        await asyncio.sleep(0.05)
        if eng.stats().kv_blocks.used == 0 and all(
                eng.backend.seq_pos_max(s) == -1 for s in range(eng.backend.config.n_seq_max)):
            return True
        eng.flush_prefix_cache()
    return False


def test_closing_the_stream_aborts_and_frees_kv(aengine):
    eng = aengine.engine

    async def main():
        got = 0
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        async with contextlib.aclosing(aengine.generate("Count to a thousand:", params)) as stream:
            async for out in stream:
                got += len(out.token_ids)
                if got >= 3:
                    break
        assert request_blocks(eng) == 0  # accounting frees at once
        return await kv_cells_released(eng)

    assert asyncio.run(main())
    assert eng.stats().num_running == 0


def test_cancelling_the_consumer_task_aborts_and_frees_kv(aengine):
    eng = aengine.engine

    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in aengine.generate("Count to a thousand:",
                                            SamplingParams(max_tokens=500, ignore_eos=True)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        assert eng.stats().num_running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert request_blocks(eng) == 0
        return await kv_cells_released(eng)

    assert asyncio.run(main())


def test_a_stream_dropped_unread_aborts_its_request(aengine):
    """A caller of submit() that drops the stream (an exception before it reads, a client
    gone) left the request to run to its max_tokens for no one; one that read it to its end
    aborts nothing when it is collected, even when its id is a later request's by then."""
    import gc

    async def main():
        before = aengine.engine.stats().generation_tokens_total
        stream = aengine.submit("Once upon a time", SamplingParams(max_tokens=400,
                                                                   ignore_eos=True))
        await stream.__anext__()  # it runs
        del stream
        gc.collect()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not aengine.engine.has_unfinished():
                break
        assert not aengine.engine.has_unfinished()
        assert aengine.engine.stats().generation_tokens_total - before < 200
        assert aengine.engine.stats().kv_blocks.used == aengine.engine.stats().prefix_cache.blocks
        # read to its end, then its id reused by a running request: dropping it aborts nothing
        done = aengine.submit("One", SamplingParams(max_tokens=2), request_id="same")
        assert [o async for o in done][-1].finished
        again = aengine.submit("Two", SamplingParams(max_tokens=30, ignore_eos=True),
                               request_id="same")
        del done
        gc.collect()
        outs = [o async for o in again]
        assert sum(len(o.token_ids) for o in outs) == 30 and outs[-1].finish_reason == "length"

    asyncio.run(main())


def test_bad_request_raises_before_first_output_and_others_continue(aengine):
    async def main():
        good = asyncio.create_task(collect(aengine, "Hello there", SamplingParams(max_tokens=5, ignore_eos=True)))
        with pytest.raises(InvalidRequestError):
            async for _ in aengine.generate("", SamplingParams()):
                pass
        return await good

    _, tokens, last = asyncio.run(main())
    assert len(tokens) == 5 and last.finished


def test_an_unexpected_step_error_ends_requests_with_an_error_not_a_hang(aengine, monkeypatch):
    calls = {"n": 0}
    real_decode = aengine.engine.runner.decode

    def broken(n_tokens):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_decode(n_tokens)

    monkeypatch.setattr(aengine.engine.runner, "decode", broken)

    async def main():
        outs = []
        async for out in aengine.generate("Count to ten:", SamplingParams(max_tokens=50, ignore_eos=True)):
            outs.append(out)
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert outs[-1].finished and outs[-1].error == "internal engine error: boom"
    monkeypatch.setattr(aengine.engine.runner, "decode", real_decode)
    # the engine keeps serving
    _, tokens, last = asyncio.run(collect(aengine, "Hello", SamplingParams(max_tokens=3, ignore_eos=True)))
    assert len(tokens) == 3 and last.error is None


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine_thread(aengine):
    """A job (or a stream) whose caller's loop is gone by the time its answer is ready: the
    answer is dropped, and the engine thread goes on serving everyone else (it used to die on
    the closed loop's RuntimeError)."""
    async def leave() -> None:
        aengine.call_on_engine_thread(lambda: time.sleep(0.3))
        aengine.call_on_engine_thread(lambda: None)  # answered after this loop has closed

    asyncio.run(leave())
    time.sleep(0.6)
    assert aengine._thread.is_alive()

    async def ask() -> int:
        return await asyncio.wait_for(aengine.call_on_engine_thread(lambda: 42), 10)

    assert asyncio.run(ask()) == 42


def test_a_long_embedding_lets_running_requests_step_between_its_chunks(model_path,
                                                                        monkeypatch):
    """An embedding goes a chunk at a time with the engine's steps between chunks and inputs
    (it held every running request up for all of it: 4-5 s for 2,048 tokens on 2 cores).
    Two embeddings asked for at once take turns whole (the context holds one input), each
    the vector the context gives in one go."""
    import numpy as np

    import justllm.engine.backend as backend_module

    monkeypatch.setattr(backend_module, "_EMBED_CHUNK", 32)
    a = AsyncEngine(Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=128)))
    try:
        long = a.tokenize("The lighthouse keeper wrote down every ship that passed. " * 40)
        long, short = long[:512], long[:100]  # 16 chunks, 4

        async def main():
            arrivals: list[float] = []
            running = asyncio.Event()

            async def stream():
                params = SamplingParams(max_tokens=1500, ignore_eos=True)
                async for _ in a.generate("Once upon a time", params):
                    arrivals.append(time.monotonic())
                    running.set()

            task = asyncio.create_task(stream())
            await asyncio.wait_for(running.wait(), 120)
            start = time.monotonic()
            both = await asyncio.gather(a.embed([long, short]), a.embed([short]))
            end = time.monotonic()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            whole = await a.call_on_engine_thread(
                lambda: [a._embedding_ctx.embed(t) for t in (long, short)])
            return both, whole, sum(start < t < end for t in arrivals)

        (pair, alone), whole, during = asyncio.run(asyncio.wait_for(main(), 300))
        # 16 + 4 + 4 chunks and an input's end: a token per step between them (before, the
        # stream's tokens stopped for the whole embedding: at most one arrived during it)
        assert during >= 10, during
        np.testing.assert_array_equal(pair[0], whole[0])
        np.testing.assert_array_equal(pair[1], whole[1])
        np.testing.assert_array_equal(alone[0], whole[1])
    finally:
        a.close()


def test_a_stepwise_job_stops_when_its_caller_leaves_or_the_server_aborts(aengine):
    """An embedding whose client left (its future cancelled) stops at its next piece instead
    of running to its end (an abandoned 256-input embedding held the engine for minutes),
    and ``abort_all`` (a shutdown's) ends one under way with its message."""
    from justllm.errors import EngineClosedError

    def job(ran: list[int], closed: list[bool]):
        def pieces():
            try:
                for _ in range(100_000):
                    ran[0] += 1
                    time.sleep(0.001)
                    yield
            finally:
                closed.append(True)
            return "whole"
        return pieces

    async def leave() -> tuple[int, list[bool]]:
        ran, closed = [0], []
        fut = aengine.call_on_engine_thread(job(ran, closed), stepwise=True)
        while ran[0] < 5:
            await asyncio.sleep(0.01)
        fut.cancel()
        deadline = time.monotonic() + 30
        while not closed and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return ran[0], closed

    ran, closed = asyncio.run(leave())
    assert closed == [True] and ran < 100_000

    async def shut() -> BaseException | None:
        ran, closed = [0], []
        fut = aengine.call_on_engine_thread(job(ran, closed), stepwise=True)
        while ran[0] < 5:
            await asyncio.sleep(0.01)
        aengine.abort_all("going away")
        try:
            await asyncio.wait_for(fut, 30)
        except EngineClosedError as e:
            return e
        return None

    error = asyncio.run(shut())
    assert isinstance(error, EngineClosedError) and str(error) == "going away"

    async def ask() -> int:  # (the engine goes on: one abort does not end later jobs)
        return await asyncio.wait_for(aengine.call_on_engine_thread(lambda: 42), 10)

    assert asyncio.run(ask()) == 42


def test_a_draining_engine_takes_a_handover_but_no_new_request(model_path):
    """A graceful shutdown refuses new requests; a prefill/decode hand-over is the second half
    of a request its prefill replica took before, and router mode stops a decode runner once
    the hand-over reached it: refused, it was a 503 for a request accepted before the
    shutdown."""
    from dataclasses import replace

    from justllm.errors import EngineClosedError

    prompt, params = "The capital of France is", SamplingParams(temperature=0.0, max_tokens=4)
    a = AsyncEngine(Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=64)))
    try:
        async def main() -> None:
            handover = None
            async for out in a.generate(prompt, replace(params, max_tokens=1), handover=True):
                handover = out.handover or handover
            assert handover is not None
            a.stop_accepting()
            with pytest.raises(EngineClosedError):
                await a.asubmit(prompt, params)
            stream = await a.asubmit(prompt, params, resume=handover)
            tokens = [t async for out in stream for t in out.token_ids]
            assert len(tokens) == 4 and tokens[0] == handover.token_ids[0]

        asyncio.run(main())
    finally:
        a.close()


def test_embedding_jobs_take_turns_between_inputs(aengine):
    """Stepwise jobs ran one after another: a request of hundreds of inputs held a one-input
    request back for all of them (an audit waited 20 s for one short embedding)."""
    tokens = aengine.tokenize("a few words to embed")

    async def main() -> None:
        big = asyncio.ensure_future(aengine.embed([tokens] * 40))
        await asyncio.sleep(0)  # (queued first)
        small = await aengine.embed([tokens])
        assert not big.done()  # the one input went between the forty
        vectors = await big
        assert len(vectors) == 40 and np.allclose(vectors[0], small[0])

    asyncio.run(main())


def test_a_schemas_grammar_is_made_once_and_the_memo_stays_bounded(aengine, monkeypatch):
    """An agent sends the same tools with every request: their grammar is made once (32 ms a
    request for ten tools of twenty properties), the same text as made anew; other schemas
    get their own, the oldest forgotten past GRAMMAR_MEMO; a bad schema is refused each
    time, never remembered."""
    import justllm.engine.async_engine as ae

    made: list[dict] = []
    real = ae.schema_grammar

    def counting(schema, text=None):
        made.append(schema)
        return real(schema, text)

    monkeypatch.setattr(ae, "schema_grammar", counting)
    monkeypatch.setattr(ae, "GRAMMAR_MEMO", 3)
    schemas = [{"type": "object", "properties": {f"p{i}": {"type": "integer"}},
                "required": [f"p{i}"]} for i in range(5)]
    first = aengine.json_grammar(schemas[0])
    assert aengine.json_grammar(dict(schemas[0])) == first == real(schemas[0])
    assert len(made) == 1
    grammars = [aengine.json_grammar(s) for s in schemas[1:4]]  # 0 is forgotten
    assert len(set(grammars + [first])) == 4 and len(made) == 4
    aengine.json_grammar(schemas[3])
    assert len(made) == 4
    aengine.json_grammar(schemas[0])
    assert len(made) == 5
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            aengine.json_grammar({"type": "strnig"})
    assert len(made) == 7


def test_a_shutdowns_abort_ends_a_request_with_its_own_counters(aengine):
    """The final output ``abort_all`` gives carries the request's counters (its arrival, its
    prompt, its tokens so far), as every other output does: it carried blank ones, arrival 0,
    so /metrics took the request's latency for the machine's uptime."""
    async def main():
        stream = aengine.submit("Once upon a time", SamplingParams(max_tokens=200,
                                                                   ignore_eos=True))
        first = await stream.__anext__()
        aengine.abort_all("going away")
        last = first
        async for out in stream:
            last = out
        return stream, first, last

    stream, first, last = asyncio.run(main())
    assert last.finished and last.error == "going away"
    assert last.metrics is first.metrics and last.metrics.arrival_time >= stream.arrival - 1
    assert last.metrics.num_prompt_tokens == len(aengine.tokenize("Once upon a time"))
