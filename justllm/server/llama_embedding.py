"""llama-server's native ``POST /embedding`` and ``POST /embeddings`` (its un-prefixed routes;
``/v1/embeddings`` is OpenAI's format), for clients written against it.

The body: ``input`` or ``content`` (llama-server's prompt forms, server/llama_completion.py:
a string, token ids, strings and ids mixed, ``{"prompt_string"}``, or an array of those; an
empty string is BOS alone), ``embd_normalize`` (llama.cpp's ``common_embd_normalize``: -1
none, 0 int16's range, 1 taxicab, 2 Euclidean (the default), p > 2 the p-norm) and ``model``
(router mode and the cluster route by it). The answer is llama-server's: an array of
``{"index", "embedding": [[...]]}``, the pooled vector inside a list (llama-server lists one
vector per token there when its pooling is ``none``; here embeddings are always pooled: the
model's own pooling, else mean, or ``--pooling``).

Where llama-server reads a field and does nothing with it, it is refused here rather than
silently ignored: both ``input`` and ``content`` (llama-server takes ``input`` and drops
``content``), and ``encoding_format: "base64"`` (llama-server's native answer is floats
whatever it says; ``/v1/embeddings`` gives base64).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post
from litestar.datastructures import State
from litestar.params import JSONBody

from justllm.errors import InvalidRequestError
from justllm.server.app import decode_request, embedding_serving, unless_disconnected
from justllm.server.embeddings import EUCLIDEAN, normalised
from justllm.server.llama_completion import llama_prompts
from justllm.server.schemas import NullAsDefault, NullInt


class LlamaEmbeddingRequest(NullAsDefault, kw_only=True):
    input: Any = None
    content: Any = None
    embd_normalize: NullInt = EUCLIDEAN  # null: the default, as llama-server reads it
    encoding_format: str = "float"
    model: str | None = None


def check_embedding(req: LlamaEmbeddingRequest) -> tuple[str, Any]:
    """The checks that need no model (router mode runs them before a load): the field that
    holds the inputs, and its value."""
    if req.input is not None and req.content is not None:
        raise InvalidRequestError('give "input" or "content", not both (they are the same '
                                  "field)", param="content")
    if req.input is None and req.content is None:
        raise InvalidRequestError('"input" or "content" must be provided', param="input")
    if req.embd_normalize < -1:
        raise InvalidRequestError("embd_normalize must be -1 (none), 0 (int16 range), 1 "
                                  "(taxicab), 2 (Euclidean) or p > 2 (p-norm)",
                                  param="embd_normalize")
    if req.encoding_format != "float":
        raise InvalidRequestError('encoding_format: this answer is floats ("float"); '
                                  "/v1/embeddings gives base64", param="encoding_format")
    return ("input", req.input) if req.input is not None else ("content", req.content)


@post(["/embedding", "/embeddings"], status_code=200,
      summary="llama-server's native embeddings: [{index, embedding: [[...]]}]")
async def embedding(data: JSONBody[LlamaEmbeddingRequest], request: Request,
                    state: State) -> Any:
    served, serving = embedding_serving(state)
    req = await decode_request(request, LlamaEmbeddingRequest)
    field, value = check_embedding(req)
    aengine = served.aengine
    done = await unless_disconnected(request, serving.pooled(
        req.model, lambda: llama_prompts(value, aengine, field), len(await request.body()),
        param=field))
    if isinstance(done, Response):
        return done
    vectors = done[0]
    return [{"index": i, "embedding": [normalised(v, req.embd_normalize).tolist()]}
            for i, v in enumerate(vectors)]
