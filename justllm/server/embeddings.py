"""``/v1/embeddings``: mean-pooled embeddings from a second context on the same GGUF.

The embeddings context is the AsyncEngine's: created on first use and computed on the engine
thread (docs/llama-cpp-facts.md: one OS thread runs llama.cpp compute), between decode steps.
"""

from __future__ import annotations

import base64
import time

import numpy as np

from justllm.engine.async_engine import AsyncEngine
from justllm.errors import InvalidRequestError
from justllm.server.lora import adapter, no_adapter_embeddings
from justllm.server.metrics import ServerMetrics
from justllm.server.openai_serving import check_model, prompt_list, text_size
from justllm.server.schemas import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage

MAX_INPUTS = 256


class EmbeddingServing:
    def __init__(self, aengine: AsyncEngine, model_id: str,
                 metrics: ServerMetrics | None = None) -> None:
        self.aengine = aengine
        self.model_id = model_id
        self.metrics = metrics

    def _inputs(self, data: EmbeddingRequest) -> list[list[int]]:
        items = prompt_list(data.input, "input")
        if len(items) > MAX_INPUTS:
            raise InvalidRequestError(f"at most {MAX_INPUTS} inputs per request", param="input")
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(self.aengine.tokenize(item))
            else:
                if not item or not all(0 <= t < self.aengine.n_vocab for t in item):
                    raise InvalidRequestError("token ids must be in the vocabulary", param="input")
                out.append(list(item))
        return out

    async def create(self, data: EmbeddingRequest) -> EmbeddingList:
        if adapter(self.aengine, data.model) is not None:  # listed in /v1/models: not a 404
            raise no_adapter_embeddings(data.model or "", self.model_id)
        check_model(data.model, self.model_id)
        start = time.perf_counter()
        token_lists = await self.aengine.off_loop(text_size(data.input),
                                                  lambda: self._inputs(data))
        vectors = await self.aengine.embed(token_lists)
        if data.dimensions is not None:
            if not 0 < data.dimensions <= vectors[0].size:
                raise InvalidRequestError(f"dimensions must be in [1, {vectors[0].size}]",
                                          param="dimensions")
            vectors = [v[:data.dimensions] / (np.linalg.norm(v[:data.dimensions]) or 1.0)
                       for v in vectors]
        items = []
        for i, v in enumerate(vectors):
            emb: list[float] | str = (base64.b64encode(v.astype(np.float32).tobytes()).decode()
                                      if data.encoding_format == "base64" else v.tolist())
            items.append(Embedding("embedding", i, emb))
        n = sum(len(t) for t in token_lists)
        if self.metrics is not None:
            self.metrics.observe_embeddings(n, time.perf_counter() - start)
        return EmbeddingList("list", items, self.model_id, EmbeddingUsage(n, n))
