"""``/v1/embeddings``: mean-pooled embeddings from a second context on the same GGUF.

The embeddings context is created on first use and computed on the engine thread (docs/llama-cpp-facts.md:
one OS thread runs llama.cpp compute), between decode steps.
"""

from __future__ import annotations

import base64

import numpy as np

from justllm.engine.async_engine import AsyncEngine
from justllm.errors import InvalidRequestError
from justllm.server.errors import APIError
from justllm.server.openai_serving import prompt_list
from justllm.server.schemas import EmbeddingRequest

MAX_INPUTS = 256


class EmbeddingServing:
    def __init__(self, aengine: AsyncEngine, model_id: str) -> None:
        self.aengine = aengine
        self.model_id = model_id
        self._ctx = None  # created on the engine thread at first use

    def _inputs(self, data: EmbeddingRequest) -> list[list[int]]:
        backend = self.aengine.engine.backend
        items = prompt_list(data.input, "input")
        if len(items) > MAX_INPUTS:
            raise InvalidRequestError(f"at most {MAX_INPUTS} inputs per request", param="input")
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(backend.tokenize(item))
            else:
                if not item or not all(0 <= t < backend.n_vocab for t in item):
                    raise InvalidRequestError("token ids must be in the vocabulary", param="input")
                out.append(list(item))
        return out

    def _embed_all(self, token_lists: list[list[int]]) -> list[np.ndarray]:
        if self._ctx is None:
            self._ctx = self.aengine.engine.backend.embedding_context()
        limit = self._ctx.n_ctx
        for tokens in token_lists:
            if len(tokens) > limit:
                raise InvalidRequestError(
                    f"an input has {len(tokens)} tokens; embeddings take at most {limit}",
                    param="input")
        return [self._ctx.embed(t) for t in token_lists]

    async def create(self, data: EmbeddingRequest) -> dict:
        if data.model is not None and data.model != self.model_id:
            raise APIError(404, f"the model '{data.model}' does not exist; this server serves "
                                f"'{self.model_id}'", type="not_found_error", param="model",
                           code="model_not_found")
        token_lists = self._inputs(data)
        vectors = await self.aengine.call_on_engine_thread(lambda: self._embed_all(token_lists))
        if data.dimensions is not None:
            if not 0 < data.dimensions <= vectors[0].size:
                raise InvalidRequestError(f"dimensions must be in [1, {vectors[0].size}]",
                                          param="dimensions")
            vectors = [v[:data.dimensions] / (np.linalg.norm(v[:data.dimensions]) or 1.0)
                       for v in vectors]
        items = []
        for i, v in enumerate(vectors):
            emb: object = (base64.b64encode(v.astype(np.float32).tobytes()).decode()
                           if data.encoding_format == "base64" else v.tolist())
            items.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(t) for t in token_lists)
        return {"object": "list", "data": items, "model": self.model_id,
                "usage": {"prompt_tokens": n, "total_tokens": n}}
