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
"""

from __future__ import annotations

import math

from justllm.core.sampling_params import SamplingParams
from justllm.engine.backend import GRAPH_STEPS, GRAPH_TOP_K_MAX, GraphSampling
from justllm.engine.sampler import RequestSampler

# Below these the graph's float32 arithmetic fails (module docstring): the temperature, and
# the temperature times min-p's gap in nats (a tempered logit of magnitude L / T has a float32
# spacing of about 1.2e-7 L / T; with logits up to ~1000 in magnitude that stays 8x below
# T * |ln min_p| from 1e-3 on).
_MIN_TEMPERATURE = 1e-3
_MIN_P_GAP = 1e-3


def graph_sampling(params: SamplingParams, sampler: RequestSampler, seq_id: int,
                   handover: bool = False) -> GraphSampling | None:
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
    return GraphSampling(params.temperature, params.top_k, params.top_p, params.min_p,
                         tuple(order), seed=seq_id)
