"""llama-server's ``POST /infill``: fill-in-the-middle for code completion (llama.vim,
llama.vscode), on models that have FIM tokens (Qwen2.5-Coder, CodeGemma, StarCoder2, ...).

The body is /completion's (server/llama_completion.py: sampling, ``samplers`` with llama.cpp's
``infill`` step, ``n_indent``, ``t_max_predict_ms``, ``n_predict`` 0 to warm the cache, the
answer's shape) and ``input_prefix`` and ``input_suffix`` (the text before and after the
cursor), ``input_extra`` (other files' chunks, ``{"filename", "text"}``) and ``prompt`` (text
that goes on from the prefix: llama.vim sends the cursor line's start). The prompt is laid
out as llama-server lays it out (core/fim.py). A model without the three FIM tokens gets a
400 saying which it lacks (llama-server answers 501).
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.params import JSONBody

from justllm.core.fim import Chunk
from justllm.engine.async_engine import AsyncEngine
from justllm.errors import InvalidRequestError
from justllm.server.app import _served, decode_request
from justllm.server.code_prompt import code_prompt
from justllm.server.llama_completion import LlamaCompletionRequest, answer, check_completion

# The keys of an input_extra chunk: its text and file name, and the time llama.vim stamps
# its chunks with (its own bookkeeping: llama-server does not read it either).
_CHUNK_KEYS = frozenset({"text", "filename", "time"})


class LlamaInfillRequest(LlamaCompletionRequest, kw_only=True, forbid_unknown_fields=True):
    """llama-server's /infill body: /completion's, and the code around the gap."""

    input_prefix: str
    input_suffix: str
    input_extra: list[Any] | None = None
    prompt: Any = ""


def _chunks(extra: list[Any] | None) -> list[Chunk]:
    chunks = []
    for i, chunk in enumerate(extra or ()):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise InvalidRequestError(f"{where}: a chunk is {{\"filename\": string, \"text\": "
                                      "string}", param=where)
        other = sorted(set(chunk) - _CHUNK_KEYS)
        if other:
            raise InvalidRequestError(f"{where}.{other[0]}: not a field of a chunk (it has "
                                      "text and filename)", param=f"{where}.{other[0]}")
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise InvalidRequestError(f"{where}.filename must be a string",
                                      param=f"{where}.filename")
        chunks.append(Chunk(name, chunk["text"]))
    return chunks


def check_infill(req: LlamaInfillRequest) -> list[Chunk]:
    """The checks that need no model (router mode runs them before a load); the chunks."""
    check_completion(req)
    if not isinstance(req.prompt, str):
        raise InvalidRequestError("prompt must be a string (on /infill it goes on from "
                                  "input_prefix)", param="prompt")
    return _chunks(req.input_extra)


def _infill_prompt(req: LlamaInfillRequest, aengine: AsyncEngine) -> list[int]:
    chunks = check_infill(req)
    missing = aengine.fim_tokens().missing()
    if missing:
        raise InvalidRequestError(f"this model cannot infill: it has no FIM "
                                  f"{', '.join(missing)} token (a code model with FIM "
                                  "tokens can, such as Qwen2.5-Coder)", param="model")
    n_predict = next((v for v in (req.n_predict, req.max_completion_tokens, req.max_tokens)
                      if v is not None), -1)
    return code_prompt(aengine, req.input_prefix, req.input_suffix, chunks, req.prompt,
                       n_predict)


@post("/infill", status_code=200,
      summary="llama-server's /infill: fill-in-the-middle with the model's FIM tokens")
async def infill(data: JSONBody[LlamaInfillRequest], request: Request, state: State) -> Any:
    req = await decode_request(request, LlamaInfillRequest)
    size = len(req.input_prefix) + len(req.input_suffix) + len(msgspec.json.encode(
        req.input_extra or []))
    return await answer(request, _served(state), req, size,
                        lambda aengine: [_infill_prompt(req, aengine)], "llama.infill")
