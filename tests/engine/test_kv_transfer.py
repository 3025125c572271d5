"""KV export and import between two engines on the demo model (prefill/decode
disaggregation's engine half): the importing engine's prefix cache holds the prefix, its
logits after the import are exactly those of a local prefill, and every bad transfer is
refused before llama.cpp sees it, leaving the engine serving."""

from __future__ import annotations

from dataclasses import replace

import pytest

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.backend import JSON_GRAMMAR
from justllm.engine.engine import Engine, Handover
from justllm.errors import HandoverError, InvalidRequestError
from justllm.kv.transfer import KVIdentity, KVTransferError, pack, unpack
from tests.helpers import assert_same_run, run_alone, run_in_fresh_engine

SENTENCE = "The history of the Roman empire is long and full of wars and emperors. "
PROMPT = SENTENCE * 20
# Past the model's 512-token sliding window: exported in window-sized chunks.
LONG = "Rivers carve valleys, winds shape dunes, and glaciers grind mountains to sand. " * 75
GREEDY = SamplingParams(max_tokens=16, temperature=0, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(model_path):
    config = EngineConfig(model=model_path, max_seqs=4, pool_blocks=128)
    prefill, decode = Engine(config), Engine(config)
    yield prefill, decode
    prefill.close()
    decode.close()


def exported(engine: Engine, prompt: str) -> bytes:
    """What a prefill replica does: compute the prompt (and its first token), export it."""
    run_alone(engine, prompt, SamplingParams(max_tokens=1, temperature=0))
    return engine.export_prefix(engine.tokenize(prompt))


def settled(engine: Engine) -> None:
    """Apply pending KV operations, then compare every sequence with llama.cpp's view."""
    engine.runner.apply_kv_ops(engine.scheduler.take_kv_ops())
    engine.check_kv()


def test_an_imported_prefix_is_a_cache_hit_with_the_same_logits(pair, model_path):
    prefill, decode = pair
    decode.flush_prefix_cache()
    blob = exported(prefill, PROMPT)
    header, chunks = unpack(blob)
    n = len(prefill.tokenize(PROMPT))
    assert list(header.tokens) == prefill.tokenize(PROMPT) and len(header.tokens) == n
    assert header.identity == prefill.kv_identity() == decode.kv_identity()
    assert len(chunks) == 1 and header.n_bytes > n * 1024  # K and V of every layer

    before = decode.stats().prefix_cache
    assert decode.import_prefix(blob) == n
    settled(decode)
    assert decode.stats().prefix_cache.blocks >= n // decode.pool.block_size

    imported = run_alone(decode, PROMPT + " Then", GREEDY)
    after = decode.stats().prefix_cache
    assert after.hits == before.hits + 1
    assert after.hit_tokens - before.hit_tokens >= n - 1  # all but the last prompt token
    # The reference: the same prompt computed locally by an engine of the same shape, alone
    # (the same batch shapes), so the logits must agree exactly, not within noise.
    reference = run_in_fresh_engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=128),
                                    PROMPT + " Then", GREEDY)
    assert_same_run(reference, imported)
    settled(decode)

    # Importing what the cache already holds changes nothing and leaks nothing.
    assert decode.import_prefix(blob) == n
    settled(decode)
    decode.flush_prefix_cache()
    settled(decode)
    assert decode.stats().kv_blocks.used == 0


def test_bad_transfers_are_refused_and_the_engine_keeps_serving(pair):
    prefill, decode = pair
    decode.flush_prefix_cache()  # (a prefix it holds already is not read again: not refused)
    blob = exported(prefill, PROMPT)
    header, chunks = unpack(blob)
    here, tokens = decode.kv_identity(), list(header.tokens)
    data = [bytes(c) for c in chunks]
    other_model = pack(KVIdentity("0" * 64, here.kv_type, here.n_layer), tokens, data,
                       header.chunk_tokens)
    other_type = pack(KVIdentity(here.model, "q8_0", here.n_layer), tokens, data,
                      header.chunk_tokens)
    transposed = pack(KVIdentity(here.model, here.kv_type, here.n_layer, v_trans=True),
                      tokens, data, header.chunk_tokens)
    corrupt = bytearray(blob)
    corrupt[-10] ^= 0xFF
    # A blob whose header and checksum are right but whose data is not llama.cpp's.
    garbage = pack(here, tokens, [b"\x01" * 4096], header.chunk_tokens)
    cases = {
        "another model file": other_model, "type q8_0": other_type,
        "stores V transposed": transposed,
        "checksum mismatch": bytes(corrupt), "truncated": blob[:-1000],
        "bad magic": b"GGUF" + blob[4:], "llama.cpp refused": garbage,
    }
    for expected, bad in cases.items():
        with pytest.raises(KVTransferError, match=expected):
            decode.import_prefix(bad)
        settled(decode)
    with pytest.raises(KVTransferError, match="no prefix of these tokens"):
        decode.export_prefix(decode.tokenize("Never computed here: a zebra plays the cello"))

    # Every refusal left the engine as it was: it serves, and its KV is as it believes.
    tokens, _ = run_alone(decode, "The capital of France is", GREEDY)
    assert len(tokens) == 16
    settled(decode)


def test_room_counts_every_cell_a_chunk_loads_not_only_the_tokens_missing(model_path, pair):
    """A prefix whose head is cached still loads whole chunks (through a scratch sequence),
    so the room asked for is the chunks' cells: with a running request holding the pool, the
    import is refused by the engine, before llama.cpp is handed bytes it has no room for, and
    fits once the request is gone."""
    prefill, _ = pair
    blob = exported(prefill, PROMPT)
    tokens = list(unpack(blob)[0].tokens)
    n = len(tokens)
    # (no host memory: the cached head must stay in the KV, however small the idle share)
    small = Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=32,  # 512 tokens
                                cache_ram=0))
    try:
        run_alone(small, SENTENCE * 13, SamplingParams(max_tokens=1, temperature=0))
        held = small.cache.match(tokens, n).length
        assert n // 2 < held < n
        rid = small.add_request("Count: " + "one two three " * 70,
                                SamplingParams(max_tokens=50, ignore_eos=True))
        small.step()
        free = small.stats().kv_blocks.free + small.stats().prefix_cache.idle_blocks
        # the tokens missing fit beside the request once the idle head goes; the chunk does not
        assert (n - held) <= free * small.pool.block_size < n
        with pytest.raises(KVTransferError, match="running requests hold the pool"):
            small.import_prefix(blob)
        settled(small)
        small.abort(rid)
        small.step()
        settled(small)
        assert small.import_prefix(blob) == n
        settled(small)
    finally:
        small.close()


def test_no_room_is_refused_before_llama_cpp_is_touched(model_path, pair):
    prefill, _ = pair
    blob = exported(prefill, PROMPT)
    n = len(unpack(blob)[0].tokens)
    small = Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=24))  # 384 tokens
    try:
        # A running request holds most of the pool: the import does not fit beside it.
        rid = small.add_request("Count: " + "one two three " * 90,
                                SamplingParams(max_tokens=50, ignore_eos=True))
        small.step()
        assert small.stats().kv_blocks.free * small.pool.block_size < n
        with pytest.raises(KVTransferError, match="no room"):
            small.import_prefix(blob)
        small.abort(rid)
        small.step()
        settled(small)
        tiny = Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=8))
        try:
            with pytest.raises(KVTransferError, match="do not fit"):
                tiny.import_prefix(blob)
        finally:
            tiny.close()
        assert small.import_prefix(blob) == n  # with the request gone, it fits
        settled(small)
        # A request sharing the imported prefix holds it and most of the pool: the same
        # prefix handed over again is here already, not "no room" (it was refused).
        rid = small.add_request(PROMPT + " And then", SamplingParams(max_tokens=60,
                                                                      ignore_eos=True))
        small.step()
        assert small.stats().kv_blocks.free * small.pool.block_size < n
        blocks = small.stats().prefix_cache.blocks
        assert small.import_prefix(blob) == n
        assert small.stats().prefix_cache.blocks == blocks
        small.abort(rid)
        small.step()
        settled(small)
    finally:
        small.close()


def test_a_prefix_longer_than_the_sliding_window_is_whole_for_every_shorter_prefix(pair):
    """llama.cpp leaves cells outside a sequence's sliding window out of its state; a prefix
    cache needs them for any shorter shared prefix. The export goes in window-sized chunks,
    so after the import a request that shares only the first ~600 tokens and then diverges
    still finds every cell (the KV check would fail the step otherwise) and answers as a
    local prefill does."""
    prefill, decode = pair
    decode.flush_prefix_cache()
    blob = exported(prefill, LONG)
    header, chunks = unpack(blob)
    n = len(header.tokens)
    window = prefill.backend.n_swa
    assert n > 2 * window and len(chunks) == -(-n // window) == 3
    assert decode.import_prefix(blob) == n
    settled(decode)
    tokens = prefill.tokenize(LONG)
    shorter = tokens[:600] + tokens[5:20]  # shares 600 tokens, then goes elsewhere
    imported = run_alone(decode, shorter, GREEDY)
    assert decode.stats().prefix_cache.hit_tokens >= 600
    prefill.flush_prefix_cache()
    reference = run_alone(prefill, shorter, GREEDY)
    assert imported[0] == reference[0]
    settled(decode)
    decode.flush_prefix_cache()
    settled(decode)


SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, logprobs=3,
                         ignore_eos=True)


def drawn_first(engine: Engine, prompt: str, params: SamplingParams) -> Handover:
    """What a prefill replica draws: the request's first token, handed over."""
    rid = engine.add_request(prompt, replace(params, max_tokens=1), handover=True)
    while True:
        for out in engine.step():
            assert out.request_id == rid and out.error is None, out
            if out.finished:
                assert out.handover is not None and out.handover.token_ids == tuple(
                    out.token_ids)
                return out.handover


def rest_of(engine: Engine, rid: str) -> tuple[list[int], list]:
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid and out.error is None, out
            tokens += out.token_ids
            logprobs += out.logprobs or []
    return tokens, logprobs


def test_a_request_resumed_from_a_handover_answers_exactly_as_it_would_whole(pair, model_path):
    """The prefill engine draws the first token with the request's own sampling (seeded); the
    decode engine imports the KV, emits that token at once (before any step), and draws the
    rest from the random state the prefill engine left: token for token and logprob for
    logprob what one engine answers alone with the same seed."""
    prefill, decode = pair
    decode.flush_prefix_cache()
    prefill.flush_prefix_cache()
    handover = drawn_first(prefill, PROMPT, SAMPLED)
    assert handover.logprobs is not None and len(handover.logprobs) == 1
    blob = prefill.export_prefix(prefill.tokenize(PROMPT))
    n = decode.import_prefix(blob)
    settled(decode)

    first = decode.resume_request(PROMPT, SAMPLED, handover)
    assert first.token_ids == list(handover.token_ids) and not first.finished
    assert first.logprobs == list(handover.logprobs) and first.text
    before = decode.stats().prefix_cache.hit_tokens
    tokens, logprobs = rest_of(decode, first.request_id)
    assert decode.stats().prefix_cache.hit_tokens - before == n  # only the given token computed
    # ... yet no prompt token was cached for this request: the prefill engine computed them
    # all (its cache was empty), and the decode engine's hit is on the KV handed over
    assert handover.cached_tokens == 0 and first.metrics.num_cached_tokens == 0
    settled(decode)

    local = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=128))
    try:
        reference = run_alone(local, PROMPT, SAMPLED)
    finally:
        local.close()
    assert first.token_ids + tokens == reference[0]
    assert [lp.logprob for lp in first.logprobs + logprobs] == \
        [lp.logprob for lp in reference[1]]
    # The seed matters: another draws another answer (so the equality above is no accident).
    other = run_alone(prefill, PROMPT, replace(SAMPLED, seed=8, logprobs=None))
    assert other[0] != reference[0]


def test_a_handover_that_ends_the_request_finishes_it_at_once(pair):
    prefill, decode = pair
    drawn_first(prefill, PROMPT, SAMPLED)
    handover = drawn_first(prefill, PROMPT, SAMPLED)  # (the prompt cached there now)
    done = decode.resume_request(PROMPT, replace(SAMPLED, max_tokens=1), handover)
    assert done.finished and done.finish_reason == "length" and done.token_ids == list(
        handover.token_ids)
    # its cached_tokens are the prefill engine's hit (they were 0: it never met a cache here)
    assert 0 < handover.cached_tokens == done.metrics.num_cached_tokens < len(
        decode.tokenize(PROMPT))
    eos = next(t for t in range(decode.backend.n_vocab) if decode.backend.is_eog(t))
    stop = decode.resume_request(PROMPT, replace(SAMPLED, ignore_eos=False, logprobs=None),
                                 Handover((eos,), handover.rng_state, prompt=handover.prompt))
    assert stop.finished and stop.finish_reason == "stop" and stop.token_ids == [eos]
    assert not decode.has_unfinished() and not decode._live
    settled(decode)


def test_a_handover_that_does_not_fit_the_request_is_refused(pair):
    prefill, decode = pair
    good = drawn_first(prefill, PROMPT, SAMPLED)
    word = decode.tokenize(" zebra")[0]
    cases = {
        "must be in": (SAMPLED, replace(good, token_ids=(decode.backend.n_vocab,))),
        "not PCG64": (SAMPLED, replace(good, rng_state={"bit_generator": "MT19937"})),
        "asks for logprobs": (SAMPLED, replace(good, logprobs=None)),
        "needs its tokens": (SAMPLED, replace(good, token_ids=())),
        "not allowed by the request's grammar": (
            replace(SAMPLED, grammar=JSON_GRAMMAR, logprobs=None),
            replace(good, token_ids=(word,), logprobs=None)),
        # drawn after another prompt (it went on from a foreign token)
        "drawn after another prompt": (SAMPLED, drawn_first(prefill, "Cats and dogs", SAMPLED)),
    }
    for expected, (params, bad) in cases.items():
        with pytest.raises(HandoverError, match=expected):
            decode.resume_request(PROMPT, params, bad)
    assert not decode.has_unfinished() and not decode._live
    with pytest.raises(InvalidRequestError, match="max_tokens 1"):
        decode.add_request(PROMPT, SAMPLED, handover=True)
    tokens, _ = run_alone(decode, "The capital of France is", GREEDY)
    assert len(tokens) == 16
    settled(decode)


def test_a_resumed_requests_record_puts_its_prefill_on_the_prefill_replica(pair):
    """Its first token came before it was scheduled here: no queueing or prefill time on this
    engine, and the phases still add up to the total."""
    prefill, decode = pair
    handover = drawn_first(prefill, PROMPT, SAMPLED)
    records = []
    decode.observe(records.append)
    try:
        first = decode.resume_request(PROMPT, replace(SAMPLED, max_tokens=4), handover)
        rest_of(decode, first.request_id)
    finally:
        decode.observe(None)
    (rec,) = records
    assert rec.completion_tokens == 4 and rec.prefill_seconds == 0.0
    assert rec.queued_seconds == pytest.approx(0.0, abs=0.05)
    assert rec.queued_seconds + rec.prefill_seconds + rec.decode_seconds == pytest.approx(
        rec.total_seconds, abs=1e-6)
    settled(decode)


def test_a_thinking_budget_goes_on_across_a_handover(pair):
    """A budget of 0 on a prompt that opened the thinking forces the end tag from the first
    token: the prefill engine forces the first of its tokens, and the decode engine, replaying
    the handed-over token into the budget, forces the rest (it would draw otherwise)."""
    prefill, decode = pair
    prompt = "Q: two plus two\nA: <think>\n"
    params = replace(SAMPLED, logprobs=None, thinking_budget=0,
                     thinking_tags=("<think>", "</think>"), thinking_open=True)
    closing = prefill.backend.tokenize("\n</think>\n\n", add_special=False)
    assert len(closing) > 1
    decode.flush_prefix_cache()
    prefill.flush_prefix_cache()
    handover = drawn_first(prefill, prompt, params)
    assert list(handover.token_ids) == closing[:1]
    decode.import_prefix(prefill.export_prefix(prefill.tokenize(prompt)))
    first = decode.resume_request(prompt, params, handover)
    tokens, _ = rest_of(decode, first.request_id)
    assert (first.token_ids + tokens)[:len(closing)] == closing
    settled(decode)


def test_an_engine_without_flash_attention_says_its_v_is_transposed(model_path, pair):
    """(a pair with different --flash-attn was refused by llama.cpp's state read only)"""
    assert not pair[0].kv_identity().v_trans  # auto: on wherever it can be
    engine = Engine(EngineConfig(model=model_path, flash_attn="off", max_seqs=2,
                                 pool_blocks=16))
    try:
        assert engine.kv_identity().v_trans
    finally:
        engine.close()
