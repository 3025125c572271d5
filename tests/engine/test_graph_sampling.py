"""--backend-sampling: plain requests' tokens chosen in llama.cpp's decode graph, the others'
on the host, side by side in one batch (engine/graph_sampling.py)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams as SP
from justllm.engine.backend import GraphSampling
from justllm.engine.graph_sampling import graph_sampling
from justllm.engine.llm import LLM
from justllm.engine.sampler import RequestSampler
from justllm.errors import EngineError
from tests.helpers import EXACT, ON_GPU, count_graph_tokens, divergence_is_noise

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "The sea was"]


@pytest.fixture(scope="module")
def llm(model_path):
    # No prefix cache: a hit moves the logits slightly, and runs here compare tokens exactly.
    llm = LLM(model_path, pool_blocks=256, max_seqs=4, backend_sampling=True,
              prefix_cache=False)
    llm.counted = count_graph_tokens(llm.engine)  # type: ignore[attr-defined]
    yield llm
    llm.close()


def tokens(llm, params) -> tuple[list[list[int]], int]:
    """Each prompt's tokens, and how many of them the graph chose (or took candidates for)."""
    before = llm.counted["graph"] + llm.counted["candidates"]
    outs = llm.generate(PROMPTS, params)
    assert not [o.error for o in outs if getattr(o, "error", None)]
    return [o.token_ids for o in outs], llm.counted["graph"] + llm.counted["candidates"] - before


def test_plain_requests_are_chosen_in_the_graph_as_the_host_would(llm):
    """Greedy in the graph is the host's argmax (a seeded request is sampled on the host); the
    cuts reach llama.cpp's chain: top_k 1, min_p near 1 or a tiny top_p leave the best token
    alone, in OpenAI's order and in llama.cpp's (``samplers``)."""
    greedy, n = tokens(llm, SP(max_tokens=10))
    assert n == 40
    host, n = tokens(llm, SP(max_tokens=10, seed=3))
    assert n == 0
    if not ON_GPU:  # (a GPU need not repeat a near tie bit for bit)
        assert greedy == host
    for params in (SP(max_tokens=10, temperature=1.0, top_k=1),
                   SP(max_tokens=10, temperature=1.3, min_p=0.999),
                   SP(max_tokens=10, temperature=0.9, top_p=1e-6),
                   SP(max_tokens=10, temperature=1.3, top_k=131072, min_p=0.999),
                   SP(max_tokens=10, temperature=1.0, top_k=1,
                      samplers=("top_k", "top_p", "temperature"))):
        got, n = tokens(llm, params)
        assert n == 40, params
        if not ON_GPU:
            assert got == greedy, params


def test_tiny_temperatures_min_p_1_and_a_huge_top_k_are_drawn_on_the_host(llm):
    """In the graph the first two drew the vocabulary's last token and the third aborted the
    process (graph_sampling.py); on the host each keeps the best token alone: greedy."""
    greedy, _ = tokens(llm, SP(max_tokens=6))
    for params in (SP(max_tokens=6, temperature=1e-8, min_p=0.05),
                   # (llama.cpp's graph top-k aborts past 128k, below the vocabulary's 262k)
                   SP(max_tokens=6, temperature=1.0, top_k=262143, min_p=0.999),
                   SP(max_tokens=6, temperature=1.0, top_k=10**6, min_p=0.999),
                   SP(max_tokens=6, temperature=1e-6),
                   SP(max_tokens=6, temperature=0.7, min_p=1.0)):
        got, n = tokens(llm, params)
        assert n == 0, params
        if not ON_GPU:
            assert got == greedy, params


def test_the_backend_never_hands_llama_cpp_a_top_k_it_aborts_on(llm):
    """Past the vocabulary a top_k is no cut; between 128k and the vocabulary it is refused
    (llama.cpp's graph top-k would abort the process); the sequence's chain is unchanged."""
    b = llm.engine.backend
    try:
        b.set_graph_sampling({0: GraphSampling(1.0, top_k=10**6)})
        assert b._graph_chains[0][0] == GraphSampling(1.0)
        with pytest.raises(EngineError, match="top_k over 131072"):
            b.set_graph_sampling({0: GraphSampling(1.0, top_k=200_000)})
        assert b._graph_chains[0][0] == GraphSampling(1.0)
    finally:
        b.set_graph_sampling({0: None})


def test_unseeded_draws_differ_between_sequences(llm):
    """Each sequence id's chain has a generator of its own: four requests for one prompt at a
    high temperature do not draw the same text. (ignore_eos: unseeded, a draw may end early,
    and the test counts 12 tokens each.)"""
    outs = llm.generate([PROMPTS[1]] * 4, SP(max_tokens=12, temperature=1.5, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert all(len(o.token_ids) == 12 for o in outs)


def test_top_p_over_the_whole_vocabulary_draws_from_candidates_the_graph_took(llm):
    """A top-p request with no top-k first, or one with a top-k of at most 1024, is not drawn
    by llama.cpp's chain (its top-p, and CUDA's top-k without CUB's, sort the whole row): the
    graph takes the row's best 1024 with their probabilities, and the request's generator
    draws from them. A tiny top-p, a min-p near 1 beside a top-p, or top-k 1 leave the best
    token alone (greedy); top_p 0.95, and top_k 40, draw every token from them."""
    greedy, _ = tokens(llm, SP(max_tokens=10))
    for params in (SP(max_tokens=10, temperature=0.9, top_p=1e-6),
                   SP(max_tokens=10, temperature=1.2, top_p=0.9, min_p=0.999),
                   SP(max_tokens=10, temperature=1.1, top_k=1, top_p=0.9)):
        before = dict(llm.counted)
        got, n = tokens(llm, params)
        assert n == 40 and llm.counted["candidates"] - before["candidates"] == 40, params
        assert llm.counted["graph"] == before["graph"]  # none drawn by llama.cpp's chain
        if not ON_GPU:
            assert got == greedy, params
    # (ignore_eos: unseeded draws, which may end early, and the counts below want all 10)
    for params in (SP(max_tokens=10, temperature=0.8, top_p=0.95, ignore_eos=True),
                   SP(max_tokens=10, temperature=0.8, top_k=40, ignore_eos=True)):
        before = dict(llm.counted)
        got, n = tokens(llm, params)
        assert n == 40 and all(len(t) == 10 for t in got)
        assert llm.counted["candidates"] - before["candidates"] == 40, params
        # (the 1024 held every such nucleus measured on this model: rarely, a row is computed
        # again)
        assert llm.counted["again"] - before["again"] <= 2, params


def test_a_draw_the_candidates_cannot_decide_is_drawn_from_the_row_computed_again(
        llm, monkeypatch):
    """Every candidate draw left undecided: each such row is computed again (its cell dropped,
    its token decoded alone at its position, no chain on its sequence) and drawn on the host;
    with a tiny top-p that is the row's argmax, the greedy text. The engine checks its view of
    the KV against llama.cpp's after every step (tests/conftest.py), and the next request on
    those sequence ids goes on as usual."""
    greedy, _ = tokens(llm, SP(max_tokens=10))
    monkeypatch.setattr(RequestSampler, "draw_candidates", lambda self, *a: None)
    before = dict(llm.counted)
    got, n = tokens(llm, SP(max_tokens=10, temperature=0.9, top_p=1e-6))
    assert n == 40 and llm.counted["again"] - before["again"] == 40
    assert all(len(t) == 10 for t in got)
    if EXACT:  # (elsewhere a row computed alone differs a little from the same row batched)
        assert got == greedy
    monkeypatch.undo()
    after, _ = tokens(llm, SP(max_tokens=10))
    if not ON_GPU:
        assert after == greedy


def test_a_batch_mixes_graph_rows_and_host_rows(llm):
    """Plain rows (graph), logprobs, a seed and a grammar (host) in one batch: the host rows
    read their logits as without the flag. The same batch with every row on the host (a seed
    on each greedy row) gives the same tokens and the same logprobs."""
    grammar = 'root ::= [a-z ]+ "."'

    def batch(seeded: bool) -> list:
        seed = 9 if seeded else None
        params = [SP(max_tokens=8, seed=seed), SP(max_tokens=8, logprobs=2),
                  SP(max_tokens=8, temperature=0.7, seed=5),
                  SP(max_tokens=8, grammar=grammar, seed=seed)]
        return llm.generate(PROMPTS, params)

    before = llm.counted["graph"]
    mixed = batch(False)
    assert llm.counted["graph"] - before == 8  # the first row's: the others need the host
    host = batch(True)
    assert len(mixed[0].token_ids) == 8
    assert mixed[1].logprobs is not None and len(mixed[1].logprobs) == 8
    if not ON_GPU:
        assert [o.token_ids for o in mixed] == [o.token_ids for o in host]
        assert mixed[1].logprobs == host[1].logprobs


def test_a_sequence_id_goes_back_to_its_logits_after_a_graph_request(model_path, caplog):
    """One sequence id, in turn: a request with logprobs (host), a plain one (the graph chooses
    its tokens, the id gets a chain), the first again: the chain is gone and it reads the same
    logits as the first time. Without --gpu the engine says that the flag is slower there."""
    with caplog.at_level(logging.WARNING, logger="justllm.engine.engine"):
        llm = LLM(model_path, pool_blocks=64, max_seqs=1, backend_sampling=True,
                  prefix_cache=False)
    warned = "--backend-sampling without --gpu" in caplog.text
    assert warned is not ON_GPU, caplog.text
    try:
        scored = SP(max_tokens=6, logprobs=3)
        first = llm.generate(PROMPTS[0], scored)[0]
        plain = llm.generate(PROMPTS[2], SP(max_tokens=6))[0]
        assert len(plain.token_ids) == 6 and llm.engine.backend._graph_chains
        again = llm.generate(PROMPTS[0], scored)[0]
        assert again.logprobs is not None and len(again.logprobs) == 6
        if ON_GPU:  # (two decodes on a GPU need not agree bit for bit)
            ok, why = divergence_is_noise(first.token_ids, first.logprobs, again.token_ids,
                                          again.logprobs)
            assert ok, why
        else:
            assert again.token_ids == first.token_ids
            assert again.logprobs == first.logprobs
    finally:
        llm.close()


def test_which_requests_go_to_the_graph():
    """Anything the graph cannot apply stays on the host (pure policy)."""
    sampler = RequestSampler(SP(), 0)
    plain = SP(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05)
    assert graph_sampling(SP(), sampler, 3) == GraphSampling()
    assert graph_sampling(plain, sampler, 3) == GraphSampling(0.8, 40, 0.95, 0.05, seed=3)
    assert graph_sampling(replace(plain, samplers=("top_k", "temperature")), sampler, 3
                          ).order == ("top_k", "temperature")
    for other in (replace(plain, seed=1), replace(plain, repeat_penalty=1.1),
                  replace(plain, presence_penalty=0.5), replace(plain, logit_bias=((5, 1.0),)),
                  replace(plain, min_tokens=2), replace(plain, logprobs=0),
                  replace(plain, prompt_logprobs=1), replace(plain, grammar='root ::= "a"'),
                  replace(plain, samplers=("top_k", "infill"))):
        assert graph_sampling(other, sampler, 3) is None, other
    assert graph_sampling(plain, sampler, 3, handover=True) is None
    # where the graph's float32 min-p would cut every token, or its scale overflow
    for other in (replace(plain, temperature=1e-8), replace(plain, min_p=1.0),
                  replace(plain, temperature=1e-3, min_p=0.5)):
        assert graph_sampling(other, sampler, 3) is None, other
    assert graph_sampling(replace(plain, temperature=0.01), sampler, 3) is not None
    assert graph_sampling(replace(plain, top_k=131073), sampler, 3) is None
    assert graph_sampling(replace(plain, top_k=131072), sampler, 3) is not None


def test_backend_sampling_does_not_combine_with_speculation():
    with pytest.raises(ValueError, match="--backend-sampling does not combine with --spec"):
        EngineConfig(backend_sampling=True, spec="ngram")
