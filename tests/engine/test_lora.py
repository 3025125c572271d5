"""LoRA adapters on the real model through real llama.cpp.

The adapters are written in the test (tests/lora_files.py): random rank-8 deltas on attn_q and
attn_v of every other layer, large enough to change greedy output. Checked: an adapter changes
the output and scale 0 is the base exactly; the base and two adapters served concurrently each
match their solo runs (within batch-shape noise, as every batching test); KV computed under one
adapter never serves another; unloading waits for the adapter's requests; broken adapters are a
one-line error; and the randomised concurrent load of test_kv_stress.py with mixed adapters
keeps llama.cpp's KV exactly what the scheduler believes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from justllm.config import EngineConfig, LoraSpec
from justllm.core.sampling_params import SamplingParams
from justllm.engine.async_engine import AsyncEngine
from justllm.engine.backend import _log_to
from justllm.engine.engine import Engine
from justllm.errors import InvalidRequestError, ModelLoadError
from justllm.kv.host_cache import HostCache, HostEntry
from tests.engine.test_kv_stress import _idle, make_prompts
from tests.helpers import PROMPTS, divergence_is_noise, run_alone
from tests.lora_files import write_adapter

GREEDY = SamplingParams(max_tokens=12, logprobs=5, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    return {"a": str(write_adapter(d / "a.gguf", seed=1)),
            "b": str(write_adapter(d / "b.gguf", seed=2)),
            "c": str(write_adapter(d / "c.gguf", seed=3))}


@pytest.fixture(scope="module")
def lora_engine(model_path, adapters):
    eng = Engine(EngineConfig(model=model_path, max_seqs=12, pool_blocks=256, lora=(
        LoraSpec("a", adapters["a"]), LoraSpec("b", adapters["b"], 0.8))))
    yield eng
    eng.close()


def under(lora: dict[str, float], params: SamplingParams = GREEDY) -> SamplingParams:
    return replace(params, lora=tuple(lora.items()))


def tokens(engine: Engine, prompt: str, lora: dict[str, float]) -> list[int]:
    return run_alone(engine, prompt, under(lora, SHORT))[0]


def cached_run(engine: Engine, prompt: str, params: SamplingParams) -> tuple[int, list[int]]:
    """One request run to its end: the prompt tokens the prefix cache gave it, and its tokens."""
    engine.add_request(prompt, params)
    out, toks = None, []
    while engine.has_unfinished():
        for o in engine.step():
            toks += o.token_ids
            out = o if o.finished else out
    assert out is not None and out.error is None
    return out.metrics.num_cached_tokens, toks


def test_an_adapter_changes_greedy_output_and_scale_zero_is_the_base(lora_engine):
    prompt = PROMPTS[0]
    base = tokens(lora_engine, prompt, {})
    a, b = tokens(lora_engine, prompt, {"a": 1.0}), tokens(lora_engine, prompt, {"b": 0.8})
    assert a != base and b != base and a != b
    assert tokens(lora_engine, prompt, {"a": 0.0}) == base
    assert tokens(lora_engine, prompt, {"a": 1.0}) == a  # deterministic under an adapter
    both = tokens(lora_engine, prompt, {"a": 1.0, "b": 0.8})
    assert both not in (a, b, base)


def test_base_and_two_adapters_concurrently_each_match_their_solo_run(lora_engine):
    sets = [{}, {"a": 1.0}, {"b": 0.8}]
    jobs = [(p, sets[i % 3]) for i, p in enumerate(PROMPTS[:6])]
    alone = [run_alone(lora_engine, p, under(s)) for p, s in jobs]
    ids = [lora_engine.add_request(p, under(s)) for p, s in jobs]
    got: dict[str, tuple[list[int], list]] = {i: ([], []) for i in ids}
    switches = lora_engine.stats().lora_switches
    while lora_engine.has_unfinished():
        for out in lora_engine.step():
            assert out.error is None, out.error
            got[out.request_id][0].extend(out.token_ids)
            got[out.request_id][1].extend(out.logprobs or [])
    exact = 0
    for (ref, ref_lp), rid in zip(alone, ids):
        toks, lps = got[rid]
        assert len(toks) == GREEDY.max_tokens
        ok, why = divergence_is_noise(ref, ref_lp, toks, lps)
        assert ok, (rid, why)
        exact += ref == toks
    assert exact >= 4, f"only {exact}/6 identical to their solo run"
    # three sets, taken in turns of at most --lora-max-steps (4) steps: switches happen, but
    # far fewer than one per step
    switched = lora_engine.stats().lora_switches - switches
    assert 3 <= switched <= 3 * GREEDY.max_tokens // 4 + 3


def test_kv_computed_under_one_adapter_never_serves_another(lora_engine):
    prompt = " ".join(f"Line {i} of a shared system prompt." for i in range(12))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    lora_engine.flush_prefix_cache()

    def cached(lora: dict[str, float]) -> tuple[int, list[int]]:
        return cached_run(lora_engine, prompt, under(lora, params))

    hit_a, toks_a = cached({"a": 1.0})
    assert hit_a == 0
    hit_b, toks_b = cached({"b": 0.8})
    assert hit_b == 0  # the same prompt, computed under a, is not b's
    hit_base, _ = cached({})
    assert hit_base == 0
    assert cached({"a": 1.0}) == (len(lora_engine.tokenize(prompt)) - 1, toks_a)
    assert cached({"b": 0.8})[1] == toks_b


def test_an_adapters_prefix_goes_to_host_memory_in_its_own_tree_and_comes_back(model_path,
                                                                               adapters):
    """Past the share of idle prefixes a prefix computed under an adapter moves to host memory
    as the base model's do, in its adapter set's tree: the same adapter gets it back (a hit,
    the same tokens), the base model and another adapter do not, and unloading the adapter
    drops it there too."""
    engine = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=128, cache_ram=64,
                                 prefix_cache_blocks=2, lora=(LoraSpec("a", adapters["a"]),
                                                              LoraSpec("b", adapters["b"]))))
    try:
        prompt = " ".join(f"Line {i} of a shared system prompt." for i in range(12))
        n = len(engine.tokenize(prompt))
        params = SamplingParams(max_tokens=4, ignore_eos=True)

        def cached(lora: dict[str, float]) -> tuple[int, list[int]]:
            got = cached_run(engine, prompt, under(lora, params))
            engine.runner.apply_kv_ops(engine.scheduler.take_kv_ops())
            engine.check_kv()
            return got

        hit_a, toks_a = cached({"a": 1.0})
        assert hit_a == 0 and engine.stats().host_cache.entries == 1
        assert engine.stats().prefix_cache.blocks <= 2  # the rest of it left the KV
        assert cached({"b": 1.0})[0] == 0 and cached({})[0] == 0  # a's cells serve neither
        assert engine.stats().host_cache.entries == 3
        restored = engine.stats().host_cache.restored
        assert cached({"a": 1.0}) == (n - 1, toks_a)
        assert engine.stats().host_cache.restored == restored + 1

        engine.finish_unload_lora(engine.begin_unload_lora("a"))
        assert engine.stats().host_cache.entries == 2  # b's and the base model's stay
        assert cached({"b": 1.0})[0] == n - 1
    finally:
        engine.close()


def test_unknown_adapters_are_refused_per_request(lora_engine):
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'zz'"):
        lora_engine.add_request("Hi", under({"zz": 1.0}))
    with pytest.raises(InvalidRequestError, match="scales"):
        SamplingParams(lora=(("a", float("inf")),))
    assert not lora_engine.has_unfinished()


def test_unloading_waits_for_its_requests_and_drops_its_cache(model_path, adapters):
    engine = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=128,
                                 lora=(LoraSpec("a", adapters["a"]),)))
    try:
        prompt = "The quick brown fox jumps over the lazy dog again and again"
        first = run_alone(engine, prompt, under({"a": 1.0}, SamplingParams(max_tokens=3)))[0]
        rid = engine.add_request(prompt, under({"a": 1.0}, SamplingParams(max_tokens=6)))
        engine.step()
        lora_id = engine.begin_unload_lora("a")
        with pytest.raises(InvalidRequestError):  # refused from the start of the unload
            engine.add_request(prompt, under({"a": 1.0}))
        assert [a.name for a in engine.lora_adapters()] == []
        while engine.lora_busy(lora_id):
            for out in engine.step():
                assert out.error is None and out.request_id == rid
        engine.finish_unload_lora(lora_id)
        engine.step()  # the dropped cache entries' KV goes
        assert engine.stats().kv_blocks.used == engine.stats().prefix_cache.blocks == 0
        # another file under the same name: a new adapter, no KV of the old one
        engine.load_lora("a", adapters["c"])
        rid = engine.add_request(prompt, under({"a": 1.0}, SamplingParams(max_tokens=3)))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert outs[-1].metrics.num_cached_tokens == 0
        assert sum((o.token_ids for o in outs), []) != first
        engine.check_kv()
    finally:
        engine.close()


def test_a_name_being_unloaded_can_be_loaded_again_at_once(model_path, adapters):
    """While an unload drained, a load of its name was refused as "loaded already", where
    every listing said it was gone."""
    engine = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=128,
                                 lora=(LoraSpec("a", adapters["a"]),)))
    try:
        prompt = "The quick brown fox jumps over the lazy dog again and again"
        engine.add_request(prompt, under({"a": 1.0}, SamplingParams(max_tokens=6)))
        engine.step()
        old = engine.begin_unload_lora("a")
        new = engine.load_lora("a", adapters["c"])
        assert new.id != old and [(a.name, a.id) for a in engine.lora_adapters()] == [
            ("a", new.id)]
        engine.add_request(prompt, under({"a": 1.0}, SamplingParams(max_tokens=3)))
        while engine.lora_busy(old):
            assert all(out.error is None for out in engine.step())
        engine.finish_unload_lora(old)
        engine.step()  # the dropped cache entries' KV goes
        assert [(a.name, a.id) for a in engine.lora_adapters()] == [("a", new.id)]
        while engine.has_unfinished():
            assert all(out.error is None for out in engine.step())
        engine.check_kv()
    finally:
        engine.close()


def test_an_adapter_replaced_in_place_finishes_its_requests_and_then_goes(model_path, adapters,
                                                                         tmp_path):
    """``load_inplace``: the new file takes the name at once for new requests; requests
    already running under the old one finish under it, and it is freed after them. A file
    llama.cpp refuses changes nothing."""
    engine = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=128,
                                 lora=(LoraSpec("a", adapters["a"]),)))
    try:
        prompt = "The quick brown fox jumps over the lazy dog again and again"
        old = run_alone(engine, prompt, under({"a": 1.0}, SamplingParams(max_tokens=6)))[0]
        bad = str(write_adapter(tmp_path / "bad.gguf", seed=9, n_embd=512))
        with pytest.raises(ModelLoadError, match="incorrect shape"):
            engine.replace_lora("a", bad)
        assert [(a.name, a.path) for a in engine.lora_adapters()] == [("a", adapters["a"])]

        running = engine.add_request(prompt, under({"a": 1.0}, SamplingParams(max_tokens=6)))
        started = engine.step()  # its prompt and first token
        lora, old_id = engine.replace_lora("a", adapters["c"])
        assert old_id is not None and [a.id for a in engine.lora_adapters()] == [lora.id]
        fresh = engine.add_request(prompt, under({"a": 1.0}, SamplingParams(max_tokens=6)))
        got: dict[str, list[int]] = {running: started[0].token_ids, fresh: []}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None
                got[out.request_id] += out.token_ids
            if not engine.lora_busy(old_id):
                engine.finish_unload_lora(old_id)  # once: the id is gone after it
                old_id = -1
        assert got[running] == old and got[fresh] != old  # each under its own weights
        assert [a.name for a in engine.lora_adapters()] == ["a"]
        assert engine.loras.get("a") is lora
        engine.runner.apply_kv_ops(engine.scheduler.take_kv_ops())  # the old one's cache goes
        engine.check_kv()
    finally:
        engine.close()


@pytest.mark.parametrize("broken, message", [
    (dict(arch="llama"), "made for a 'llama' model; this model is 'gemma3'"),
    (dict(n_embd=512), "llama.cpp refused it: tensor 'blk.0.attn_q.weight' has incorrect "
                       "shape"),
    (dict(alpha_as_int=True), "adapter.lora.alpha must be a float32"),
])
def test_a_broken_adapter_is_a_one_line_error(model_path, tmp_path, broken, message):
    bad = write_adapter(tmp_path / "bad.gguf", seed=4, **broken)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=32,
                            lora=(LoraSpec("bad", str(bad)),)))
    from justllm.cli import app

    r = CliRunner().invoke(app, ["run", model_path, "--lora", f"bad={bad}", "-p", "Hi", "-n",
                                 "1", "--pool-blocks", "32"])
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_the_model_file_itself_is_not_an_adapter(model_path):
    with pytest.raises(ModelLoadError, match="not a LoRA adapter"):
        Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=32,
                            lora=(LoraSpec("m", model_path),)))
    # What makes one is justllm's own command (it named llama.cpp's script, as the README
    # does not).
    from justllm.models.lora import check_lora_file

    with pytest.raises(ModelLoadError, match=r"not a LoRA adapter \(general.type is 'model', "
                                             r"not 'adapter'; `justllm convert ADAPTER_DIR` "
                                             r"converts a PEFT adapter into one\)$"):
        check_lora_file(model_path, "gemma3")


# ---- randomised concurrent load with mixed adapters --------------------------------------------

async def _client(a: AsyncEngine, rng: random.Random, prompt: list[int], i: int,
                  results: dict) -> None:
    await asyncio.sleep(rng.uniform(0, 4))
    lora = rng.choice(((), (("a", 1.0),), (("b", 0.8),), (("a", 0.5), ("b", 0.8))))
    params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice((0.0, 0.8)),
                            seed=i, ignore_eos=True, lora=lora)
    outs = []

    async def consume(limit: int | None) -> None:
        async with contextlib.aclosing(a.generate(prompt, params)) as gen:
            async for out in gen:
                outs.append(out)
                if limit is not None and len(outs) >= limit:
                    return

    mode = rng.random()
    if mode < 0.15:
        task = asyncio.create_task(consume(None))
        await asyncio.sleep(rng.uniform(0.0, 0.6))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        results["cancelled"] += 1
    elif mode < 0.3:
        await consume(rng.randint(1, 3))
        results["left"] += 1
    else:
        await consume(None)
        assert outs and outs[-1].finished
        assert sum(len(o.token_ids) for o in outs) == params.max_tokens
        results["completed"] += 1
    assert not [o.error for o in outs if o.error]


def test_random_concurrent_load_with_mixed_adapters_keeps_kv_consistent(model_path, adapters,
                                                                         monkeypatch):
    """test_kv_stress.py's load (shared prefixes, a small pool that evicts and preempts,
    prompts past the sliding window, clients that leave) with each request under the base
    model, adapter a, b or both: every step is KV-checked (tests/conftest.py), and when idle
    the pool holds exactly the prefix cache. Run twice, the second round after the first has
    ended: idle prefixes past a 6-block share move to host memory and back, each adapter set's
    in its own tree."""
    engine = Engine(EngineConfig(model=model_path, max_seqs=6, max_prefill=3, pool_blocks=80,
                                 block_size=16, spare_seq_ids=6, chunk_size=64, n_batch=128,
                                 lora=(LoraSpec("a", adapters["a"]),
                                       LoraSpec("b", adapters["b"], 0.8)),
                                 lora_max_steps=2, cache_ram=64, prefix_cache_blocks=6))
    assert engine.config.check_kv
    restored_trees: list = []  # the tree of each prefix brought back from host memory
    used = HostCache.used

    def recorded(self: HostCache, entry: HostEntry, tokens: int) -> None:
        restored_trees.append(entry.tree)
        used(self, entry, tokens)

    monkeypatch.setattr(HostCache, "used", recorded)
    a = AsyncEngine(engine)

    async def drive() -> None:
        rng = random.Random(7)
        words = engine.tokenize(" apple river stone light")
        prompts = make_prompts(rng, words[1:], words[0], 36)
        results = {"cancelled": 0, "left": 0, "completed": 0}
        for _ in range(2):  # the second round: the same prompts under the same adapter sets
            await asyncio.gather(*[_client(a, random.Random(700 + i), p, i, results)
                                   for i, p in enumerate(prompts)])
            await _idle(a, engine)
        assert results["completed"] >= 20, results
        await a.call_on_engine_thread(engine.check_kv)
        stats = engine.stats()
        assert stats.kv_blocks.used == stats.prefix_cache.blocks
        assert stats.lora_switches > 3
        assert stats.host_cache.stored > 0, stats.host_cache
        assert set(restored_trees) - {()}, restored_trees  # adapter sets' prefixes came back
        await a.call_on_engine_thread(engine.flush_prefix_cache)
        await _idle(a, engine)
        assert engine.stats().kv_blocks.used == 0

    try:
        asyncio.run(drive())
    finally:
        a.close()


def test_an_adapter_path_with_a_tilde_is_the_file_llama_cpp_opens(model_path, tmp_path,
                                                                   monkeypatch):
    """"~/a.gguf" passed the file check (expanded) and llama.cpp, given it as written, could
    not open it: /v1/load_lora_adapter answered 400 for a file that exists."""
    home = tmp_path / "home"
    home.mkdir()
    write_adapter(home / "a.gguf", seed=1)
    monkeypatch.setenv("HOME", str(home))
    engine = Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=32))
    try:
        lora = engine.load_lora("t", "~/a.gguf")
        assert lora.path == str(home / "a.gguf")
        assert [(a.name, a.path) for a in engine.lora_adapters()] == [("t", lora.path)]
        engine.finish_unload_lora(engine.begin_unload_lora("t"))
        new, old = engine.replace_lora("t", "~/a.gguf")  # in place too
        assert old is None and new.path == str(home / "a.gguf")
    finally:
        engine.close()
    # and as the Python API's LoraSpec gives it, at start
    engine = Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=32,
                                 lora=(LoraSpec("s", "~/a.gguf"),)))
    try:
        assert [a.path for a in engine.lora_adapters()] == [str(home / "a.gguf")]
    finally:
        engine.close()


def test_a_grammar_compiled_beside_the_engine_never_takes_its_log(model_path, adapters):
    """llama.cpp's log callback is one for the whole process. A prepare worker compiling a
    grammar used to set a callback of its own, made for that call, while the engine thread
    ran llama_decode: the engine's lines (an adapter set changed makes llama.cpp reserve its
    graphs again and log it) went to the grammar's sink, and once the call ended the callback
    was freed while llama.cpp could still call it, a segfault under mixed load (a grammar and
    adapter sets). Each thread's call now keeps only its own thread's lines."""
    engine = Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=64,
                                 lora=(LoraSpec("a", adapters["a"]),)))
    try:
        held, done = threading.Event(), threading.Event()
        lines: list[tuple[int, str]] = []

        def worker() -> None:  # as a grammar's compile does, on a prepare worker
            with _log_to(lambda level, text: lines.append((level, text))):
                held.set()
                done.wait(60)

        t = threading.Thread(target=worker)
        t.start()
        assert held.wait(60)
        try:
            for lora in ({"a": 1.0}, {}, {"a": 1.0}):  # each change: the graphs reserved again
                run_alone(engine, "Hello there", under(lora, SHORT))
        finally:
            done.set()
            t.join()
        assert engine.stats().lora_switches >= 2
        assert lines == [], lines[:3]
        # the sink is the worker's alone, and gone with its call: a grammar still compiles
        assert engine.backend.grammar_error('root ::= "a"') is None
    finally:
        engine.close()
