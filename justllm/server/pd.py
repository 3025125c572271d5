"""Prefill/decode disaggregation, the replica's half: two binary endpoints between replicas
(the gateway calls them; clients never do).

``POST /pd/prefill?path=/v1/chat/completions`` (role ``prefill`` or ``both``), body: the
client's OpenAI request. The prompt is rendered exactly as the route would (chat template and
tools included), computed, and each choice's first token drawn with the request's own
sampling. The answer (``application/octet-stream``, streamed in 1 MiB pieces) is the
*hand-over*: a u32 little-endian length, that many bytes of JSON (per choice: the token, its
logprobs when asked for, the sampler's random state after the draw), then the prompt's KV as
``kv/transfer.py`` packs it (header, checksum, llama.cpp state).

``POST /pd/decode?path=...`` (role ``decode`` or ``both``), body: a u32 little-endian length,
the client's request (JSON), then the hand-over. The KV is imported into the prefix cache and
the request served as the route serves it (its ``X-PD`` header says how: ``handed-over``,
``kv-refused`` or ``handover-refused``), going on from the prefill replica's first tokens:
they are its first output, sent at once, and the next token is drawn from the random state
the prefill replica left (a seed answers the same as without PD). Only that token's KV is
computed here. A KV import that is refused (another model, a bad checksum, a truncated
transfer, no room) is counted and the prompt computed here; a hand-over that does not fit the
request (or did not arrive whole) is counted and the request served whole: slower, never lost.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import msgspec
from litestar import Request, Response, Router, post
from litestar.datastructures import State
from litestar.params import FromQuery
from litestar.response import Stream

from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Handover, TokenLogprob, check_request_fits
from justllm.errors import HandoverError
from justllm.kv.transfer import KVTransferError
from justllm.server.errors import APIError
from justllm.server.openai_serving import Job, text_size
from justllm.server.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
PATHS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
PIECE = 1 << 20
MAX_PD_BODY = 2**31  # a request plus the KV of a long prompt (~18 KiB a token, demo model)


def _request(path: str | None, raw: bytes | memoryview) -> ChatCompletionRequest | CompletionRequest:
    cls = PATHS.get(path or "")
    if cls is None:
        raise APIError(400, f"path must be one of {', '.join(PATHS)}", param="path")
    return msgspec.json.decode(raw, type=cls)


def _role_allows(state: State, role: str) -> None:
    mine = state["config"].role
    if mine not in (role, "both"):
        raise APIError(409, f"this replica's role is {mine}, not {role}",
                       code="wrong_role")


class _Logprob(msgspec.Struct, frozen=True):
    logprob: float
    top: list[tuple[int, float]]


class _Choice(msgspec.Struct, frozen=True):
    tokens: list[int]
    rng: dict[str, Any]
    logprobs: list[_Logprob] | None = None
    prompt: str = ""  # the prompt's digest (engine.prompt_digest): the decode side checks it
    cached: int = 0  # the prompt tokens the prefill replica's cache held (cached_tokens)


class _Head(msgspec.Struct, frozen=True):
    choices: list[_Choice]


def handover_bytes(handovers: list[Handover]) -> bytes:
    """The hand-over's head: its length (u32 LE) and JSON; the KV follows it."""
    head = msgspec.json.encode(_Head([_Choice(
        list(h.token_ids), h.rng_state,
        None if h.logprobs is None else [_Logprob(lp.logprob, list(lp.top))
                                         for lp in h.logprobs], h.prompt, h.cached_tokens)
        for h in handovers]))
    return struct.pack("<I", len(head)) + head


def read_handover(data: memoryview) -> tuple[list[Handover] | None, memoryview]:
    """The hand-over's choices and the KV after them. None for the choices when the head did
    not arrive whole (the KV is then empty: its import is refused as truncated) or is not
    one."""
    if len(data) < 4:
        return None, data[:0]
    (n,) = struct.unpack("<I", data[:4])
    if len(data) < 4 + n:
        return None, data[:0]
    try:
        head = msgspec.json.decode(data[4:4 + n], type=_Head)
    except msgspec.DecodeError:
        return None, data[4 + n:]
    return [Handover(tuple(c.tokens), c.rng, None if c.logprobs is None else tuple(
        TokenLogprob(t, lp.logprob, tuple(lp.top))
        for t, lp in zip(c.tokens, c.logprobs)), c.prompt, max(c.cached, 0))
        for c in head.choices], data[4 + n:]


def _jobs(served: Any, req: ChatCompletionRequest | CompletionRequest) -> list[Job]:
    """The request's choices as the route would submit them (one prompt)."""
    serving = served.completions
    if isinstance(req, ChatCompletionRequest):
        jobs, _ = serving.chat_jobs(req)
    else:
        jobs = serving.completion_jobs(req)
        if len({str(p) for p, _ in jobs}) != 1:
            raise APIError(409, "a batch of prompts is served whole, not disaggregated",
                           code="not_disaggregated")
    if any(params.prompt_logprobs is not None for _, params in jobs):
        # Every prompt row's logprobs are the prefill's; they do not travel with the KV.
        raise APIError(409, "requests for prompt logprobs are served whole, not "
                       "disaggregated", code="not_disaggregated")
    if any(not params.cache_prompt for _, params in jobs):
        # The decode half would take nothing from the KV handed over, and compute it again.
        raise APIError(409, "requests with cache_prompt false are served whole, not "
                       "disaggregated", code="not_disaggregated")
    if req.truncate_prompt_tokens is not None:  # (the prompt the prefill half computes)
        raise APIError(409, "requests that truncate their prompt are served whole, not "
                       "disaggregated", code="not_disaggregated")
    if any(params.lora for _, params in jobs):
        # Its KV is the adapter's; the transfer header names the model file only.
        raise APIError(409, "requests for a LoRA adapter are served whole, not disaggregated",
                       code="not_disaggregated")
    return jobs


@post("/prefill", status_code=200, include_in_schema=False,
      summary="Compute a request's prompt, draw its first token, export its KV")
async def prefill(request: Request, state: State, path: FromQuery[str | None] = None) -> Stream | Response:
    from justllm.server.app import _served, origin, unless_disconnected

    _role_allows(state, "prefill")
    served = _served(state)
    req = _request(path, await request.body())
    jobs = await served.aengine.off_loop(text_size(req), lambda: _jobs(served, req))
    aengine = served.aengine
    api = "openai.chat" if isinstance(req, ChatCompletionRequest) else "openai.completions"
    # the records of the first tokens
    came = served.completions.answered_as(origin(request, api, bool(req.stream)), req.model)

    prompt = jobs[0][0]
    tokens = (await aengine.off_loop(len(prompt), lambda: aengine.tokenize(prompt))
              if isinstance(prompt, str) else list(prompt))
    for _, params in jobs:  # what the decode half would refuse, refused before the prefill
        check_request_fits(len(tokens), params.max_tokens, aengine.max_request_tokens)

    async def first(prompt: str | list[int], params: SamplingParams) -> Handover:
        # (one token here: a min_tokens past it is the decode half's to hold)
        one = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        timed = False
        async for out in aengine.generate(prompt, one, handover=True, origin=came):
            # the replica's part of the request's TTFT, as the README says (it had none)
            timed = timed or served.metrics.observe_first_token(out.metrics)
            if out.error:
                raise APIError(503, f"the prompt could not be computed: {out.error}",
                               type="server_error", code="prefill_failed")
            if out.handover is not None:
                return out.handover
        raise APIError(503, "the prompt's first token was not drawn", type="server_error",
                       code="prefill_failed")

    # The choices share the prompt; the gateway closes the connection when its client leaves,
    # and the prompt is aborted then.
    drawn = await unless_disconnected(request, asyncio.gather(*(first(*j) for j in jobs)))
    if isinstance(drawn, Response):
        served.metrics.pd_prefills_aborted.labels(served.model_id).inc()
        return drawn
    try:
        blob, seconds = await aengine.export_prefix(tokens)
    except KVTransferError as e:
        raise APIError(503, f"the prompt could not be exported: {e}", type="server_error",
                       code="kv_export_failed") from None
    metrics, model = served.metrics, served.model_id
    metrics.pd_seconds.labels(model, "export").observe(seconds)
    metrics.pd_exports.labels(model).inc()
    metrics.pd_bytes.labels(model, "export").inc(len(blob))
    head = handover_bytes(list(drawn))

    async def pieces() -> AsyncIterator[bytes]:
        yield head
        for at in range(0, len(blob), PIECE):
            yield blob[at:at + PIECE]

    return Stream(pieces(), media_type="application/octet-stream",
                  headers={"Content-Type": "application/octet-stream",
                           "Content-Length": str(len(head) + len(blob))})


@post("/decode", status_code=200, summary="Import a prompt's KV and serve the request",
      include_in_schema=False)
async def decode(request: Request, state: State, path: FromQuery[str | None] = None) -> Any:
    from justllm.server.app import _served, origin, sse_response, unless_disconnected

    _role_allows(state, "decode")
    served = _served(state)
    body = await request.body()
    if len(body) < 4:
        raise APIError(400, "the body must start with the request's length")
    (n,) = struct.unpack("<I", body[:4])
    if len(body) < 4 + n:
        raise APIError(400, "the body is shorter than its request")
    view = memoryview(body)
    req = _request(path, view[4:4 + n])
    metrics, model = served.metrics, served.model_id
    resume, kv = read_handover(view[4 + n:])
    how = "handed-over"  # the answer's X-PD: what came of the hand-over
    try:
        _, seconds = await served.aengine.import_prefix(kv)
    except KVTransferError as e:
        reason = "truncated" if "truncated" in str(e) else "refused"
        metrics.pd_import_failures.labels(model, reason).inc()
        log.warning("KV import refused, computing the prompt here: %s", e)
        how = "kv-refused"
    else:
        metrics.pd_seconds.labels(model, "import").observe(seconds)
        metrics.pd_imports.labels(model).inc()
        metrics.pd_bytes.labels(model, "import").inc(len(kv))
    if resume is None:
        metrics.pd_import_failures.labels(model, "handover").inc()
        log.warning("no hand-over came with the KV, serving the request whole")
        how = "handover-refused"
    serving = served.completions

    api = "openai.chat" if isinstance(req, ChatCompletionRequest) else "openai.completions"
    came = origin(request, api, bool(req.stream))

    def serve(resume: list[Handover] | None) -> Any:
        if isinstance(req, ChatCompletionRequest):
            return serving.chat(req, resume, came)
        return serving.completions(req, resume, came)

    try:
        result = await unless_disconnected(request, serve(resume))
    except HandoverError as e:  # a prefill replica's draw this request cannot go on from
        metrics.pd_import_failures.labels(model, "handover").inc()
        log.warning("hand-over refused, serving the request whole: %s", e)
        result = await unless_disconnected(request, serve(None))
        how = "handover-refused"
    headers = {"X-PD": how}
    if isinstance(result, AsyncIterator):
        return sse_response(result, headers)
    return result if isinstance(result, Response) else Response(result, headers=headers)


def pd_router() -> Router:
    from justllm.server.app import require_api_key

    return Router(path="/pd", route_handlers=[prefill, decode], guards=[require_api_key],
                  request_max_body_size=MAX_PD_BODY)
