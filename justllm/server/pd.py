"""Prefill/decode disaggregation, the replica's half: two binary endpoints between replicas
(the gateway calls them; clients never do).

``POST /pd/prefill?path=/v1/chat/completions`` (role ``prefill`` or ``both``), body: the
client's OpenAI request. The prompt is rendered exactly as the route would (chat template
included), computed, and answered as ``application/octet-stream``: the KV transfer bytes of
``kv/transfer.py`` (header, checksum, llama.cpp state), streamed in 1 MiB pieces.

``POST /pd/decode?path=...`` (role ``decode`` or ``both``), body: a u32 little-endian length,
the client's request (JSON), then those bytes. The KV is imported into the prefix cache and
the request served as the route serves it, so its prompt is a cache hit and only its last
token is computed here. An import that is refused (another model, a bad checksum, a truncated
transfer, no room) is counted and the prompt computed here instead: slower, never lost.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, Router, post
from litestar.datastructures import State
from litestar.params import Parameter
from litestar.response import Stream

from justllm.core.sampling_params import SamplingParams
from justllm.errors import InvalidRequestError
from justllm.kv.transfer import KVTransferError
from justllm.server.errors import APIError
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


async def _prompt_tokens(state: State, req: ChatCompletionRequest | CompletionRequest
                         ) -> list[int]:
    """The tokens the route itself would compute for the request (one prompt)."""
    from justllm.server.app import _served

    served = _served(state)
    serving = served.completions
    serving.check_model(req.model)
    if isinstance(req, ChatCompletionRequest):
        return served.aengine.tokenize(serving.chat_prompt(req.messages))
    prompts = serving._completion_prompts(req.prompt)
    if len(prompts) != 1:
        raise InvalidRequestError("a batch of prompts is not disaggregated", param="prompt")
    prompt = prompts[0]
    return served.aengine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)


@post("/prefill", status_code=200, summary="Compute a request's prompt and export its KV",
      include_in_schema=False)
async def prefill(request: Request, state: State, path: Annotated[str | None, Parameter(query="path")] = None) -> Stream | Response:
    from justllm.server.app import _served, unless_disconnected

    _role_allows(state, "prefill")
    served = _served(state)
    tokens = await _prompt_tokens(state, _request(path, await request.body()))

    async def compute() -> None:
        async for _ in served.aengine.generate(tokens, SamplingParams(max_tokens=1,
                                                                      temperature=0.0)):
            pass  # the prompt is now in the prefix cache

    # The gateway closes the connection when its client leaves: the prompt is aborted then.
    left = await unless_disconnected(request, compute())
    if isinstance(left, Response):
        served.metrics.pd_prefills_aborted.labels(served.model_id).inc()
        return left
    try:
        blob, seconds = await served.aengine.export_prefix(tokens)
    except KVTransferError as e:
        raise APIError(503, f"the prompt could not be exported: {e}", type="server_error",
                       code="kv_export_failed") from None
    metrics, model = served.metrics, served.model_id
    metrics.pd_seconds.labels(model, "export").observe(seconds)
    metrics.pd_exports.labels(model).inc()
    metrics.pd_bytes.labels(model, "export").inc(len(blob))

    async def pieces() -> AsyncIterator[bytes]:
        for at in range(0, len(blob), PIECE):
            yield blob[at:at + PIECE]

    return Stream(pieces(), media_type="application/octet-stream",
                  headers={"Content-Type": "application/octet-stream",
                           "Content-Length": str(len(blob))})


@post("/decode", status_code=200, summary="Import a prompt's KV and serve the request",
      include_in_schema=False)
async def decode(request: Request, state: State, path: Annotated[str | None, Parameter(query="path")] = None) -> Any:
    from justllm.server.app import _served, sse_response, unless_disconnected

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
    try:
        _, seconds = await served.aengine.import_prefix(view[4 + n:])
    except KVTransferError as e:
        reason = "truncated" if "truncated" in str(e) else "refused"
        metrics.pd_import_failures.labels(model, reason).inc()
        log.warning("KV import refused, computing the prompt here: %s", e)
    else:
        metrics.pd_seconds.labels(model, "import").observe(seconds)
        metrics.pd_imports.labels(model).inc()
        metrics.pd_bytes.labels(model, "import").inc(len(body) - 4 - n)
    serving = served.completions
    work = serving.chat(req) if isinstance(req, ChatCompletionRequest) else \
        serving.completions(req)
    result = await unless_disconnected(request, work)
    return sse_response(result) if isinstance(result, AsyncIterator) else result


def pd_router() -> Router:
    from justllm.server.app import require_api_key

    return Router(path="/pd", route_handlers=[prefill, decode], guards=[require_api_key],
                  request_max_body_size=MAX_PD_BODY)
