"""Which requests' tokens llama.cpp chooses inside the decode graph (``--backend-sampling``).

llama.cpp's backend samplers (greedy, top-k, temperature, min-p, top-p, and a draw) run in the
decode graph, on the device that holds the output layer, so no 262k-wide logits row is copied
back and scanned on the CPU for those rows (engine/backend.py ``set_graph_sampling``). They
cover the plain requests, which are what most clients send. A request whose token needs more
than they do is sampled on the host as without the flag:

- penalties, ``logit_bias``, ``min_tokens``' mask, a grammar or a thinking budget: they change
  the row before the draw, or the token after it, in ways the graph cannot;
- ``logprobs`` and ``prompt_logprobs``: they read the row;
- a ``seed``: the engine's own generator reproduces it (llama.cpp's draws another stream);
- a PD hand-over: it carries the host generator's state to the decode side;
- a top-k over 128k (llama.cpp's graph top-k aborts the process past its 128k probe row);
- a temperature or min-p the graph's float32 arithmetic gets wrong: llama.cpp's min-p keeps
  the tokens strictly above ``best + ln(min_p)``, and at a tiny temperature (or min_p 1) that
  threshold rounds to the best logit itself, so every token is cut and the draw returns the
  vocabulary's last token (seen with min_p 0.05 at temperature 1e-8); at 1e-40 the scale
  overflows even without min-p.

An unseeded request draws from the generator of its sequence id's chain, seeded with that id,
which goes on across the requests the id serves: every chain set or removed makes llama.cpp
reserve its graphs again, so one kept for the next request with the same settings costs
nothing.

Two kinds of request, in OpenAI's order, are not drawn by llama.cpp's chain: top-p over the
whole vocabulary, since llama.cpp's graph top-p sorts all 262k logits of each row (on an H200
that capped bare decoding near 1,100 tok/s from 8 sequences up), and a top-k of at most
``CANDIDATES``, since ggml's CUDA top-k sorts the whole row too where CUB's own top-k is
missing (CUDA before 13.1). Their graph takes the row's best ``CANDIDATES`` tokens with their
probabilities instead (engine/backend.py
``_CandidatesSampler``: from ``CANDIDATE_SLICE``-wide slices first where the vocabulary is
large, since CUDA's top-k sorts a whole row without CUB's own top-k, and slices of 1024 sort in
shared memory), and the request's own generator draws the nucleus from them
(``RequestSampler.draw_candidates``), exactly; when they cannot decide it, the engine computes
the row again and draws from it on the host.
"""

from __future__ import annotations

import math

from justllm.core.sampling_params import SamplingParams
from justllm.engine.backend import GRAPH_STEPS, GRAPH_TOP_K_MAX, GraphSampling, most_candidates
from justllm.engine.sampler import RequestSampler

# Below these the graph's float32 arithmetic fails (module docstring): the temperature, and
# the temperature times min-p's gap in nats (a tempered logit of magnitude L / T has a float32
# spacing of about 1.2e-7 L / T; with logits up to ~1000 in magnitude that stays 8x below
# T * |ln min_p| from 1e-3 on).
_MIN_TEMPERATURE = 1e-3
_MIN_P_GAP = 1e-3
# The candidates a top-p row's graph takes (the 0.95 nucleus at temperature 0.8 held at most
# 591 tokens in 240 rows sampled from the demo model), and the slices they come from.
CANDIDATES = 1024
CANDIDATE_SLICE = 1024


def graph_sampling(params: SamplingParams, sampler: RequestSampler, seq_id: int,
                   handover: bool = False, n_vocab: int = 0) -> GraphSampling | None:
    """The chain that draws this request's tokens in the graph, or None when it is sampled on
    the host (module docstring)."""
    if (params.seed is not None or params.has_penalties or params.logit_bias
            or params.min_tokens or params.logprobs is not None
            or params.prompt_logprobs is not None or params.grammar is not None
            or sampler.constraint is not None or sampler.budget is not None or handover):
        return None
    order = params.samplers if params.samplers is not None else GRAPH_STEPS
    if not set(order) <= set(GRAPH_STEPS):  # llama.cpp's infill step has no graph version
        return None
    if params.greedy:
        return GraphSampling()
    t = params.temperature
    if t < _MIN_TEMPERATURE or (params.min_p > 0.0 and t * -math.log(params.min_p) < _MIN_P_GAP):
        return None
    if params.top_k > GRAPH_TOP_K_MAX:  # (llama.cpp would abort: engine/backend.py)
        return None
    cuts_the_row = (params.top_p < 1.0 and not 0 < params.top_k < n_vocab) or (
        0 < params.top_k <= CANDIDATES)
    if cuts_the_row and params.samplers is None and n_vocab > CANDIDATES:
        segment = (CANDIDATE_SLICE if most_candidates(n_vocab, CANDIDATE_SLICE) >= CANDIDATES
                   else 0)
        return GraphSampling(params.temperature, candidates=CANDIDATES, segment=segment)
    return GraphSampling(params.temperature, params.top_k, params.top_p, params.min_p,
                         tuple(order), seed=seq_id)
