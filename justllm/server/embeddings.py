"""``/v1/embeddings``: pooled embeddings from a second context on the same GGUF (pooled as
the model says, else mean, or as ``--pooling`` says).

The embeddings context is the AsyncEngine's: created on first use and computed on the engine
thread (docs/llama-cpp-facts.md: one OS thread runs llama.cpp compute), between decode steps.
It gives the pooled vector as llama.cpp pools it; each API normalises it its own way
(:func:`normalised`: OpenAI's and Ollama's unit length, llama-server's ``embd_normalize``).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from justllm.engine.async_engine import AsyncEngine
from justllm.errors import InvalidRequestError
from justllm.server.lora import adapter, no_adapter_embeddings
from justllm.server.metrics import ServerMetrics
from justllm.server.openai_serving import check_model, keep_last, prompt_list, text_size
from justllm.server.schemas import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage

log = logging.getLogger(__name__)

# OpenAI's limits on one embeddings request: 2,048 inputs, 300,000 tokens in all (LangChain
# sends 1,000 texts at a time; a bound on the tokens keeps one request from holding the
# embeddings of every other client for many minutes: they take turns between inputs).
MAX_INPUTS = 2048
MAX_REQUEST_TOKENS = 300_000
RERANKER_ONLY = ("this model is a reranker (its pooling is rank): it scores (query, document) "
                 "pairs at /v1/rerank and makes no embeddings")
NOT_A_RERANKER = ("this model is not a reranker (its pooling is not rank): reranking needs a "
                  "cross-encoder such as bge-reranker (or --pooling rank for one whose GGUF "
                  "does not say so)")
EUCLIDEAN = 2  # llama-server's embd_normalize for unit length, its default


def normalised(v: np.ndarray, norm: int = EUCLIDEAN) -> np.ndarray:
    """``v`` scaled as llama.cpp's ``common_embd_normalize`` scales it (llama-server's
    ``embd_normalize``): -1 not at all, 0 so that its largest magnitude is 32760 (int16's
    range), 2 to unit length, any other p > 0 to unit p-norm (1: taxicab). A zero vector stays
    zero."""
    x = v.astype(np.float64)
    if norm == -1:
        size = 1.0
    elif norm == 0:
        size = float(np.max(np.abs(x))) / 32760.0 if x.size else 0.0
    elif norm == EUCLIDEAN:
        size = float(np.sqrt(np.dot(x, x)))
    else:
        size = float(np.sum(np.abs(x) ** norm) ** (1.0 / norm))
    return (x * (1.0 / size if size > 0 else 0.0)).astype(np.float32)


class EmbeddingServing:
    def __init__(self, aengine: AsyncEngine, model_id: str,
                 metrics: ServerMetrics | None = None) -> None:
        self.aengine = aengine
        self.model_id = model_id
        self.metrics = metrics

    def _tokens(self, items: Sequence[str | list[int]], param: str, truncate: bool,
                keep: int | None = None) -> list[list[int]]:
        if len(items) > MAX_INPUTS:
            raise InvalidRequestError(f"at most {MAX_INPUTS} inputs per request", param=param)
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(self.aengine.tokenize(item))
            else:
                if not item or not all(0 <= t < self.aengine.n_vocab for t in item):
                    raise InvalidRequestError("token ids must be in the vocabulary", param=param)
                out.append(list(item))
        if truncate:  # Ollama's: the end of each input cut to fit
            out = [t[:self.aengine.embedding_limit] for t in out]
        if keep is not None:  # vLLM's truncate_prompt_tokens: each input's last tokens
            k = keep_last(keep, self.aengine.embedding_limit)
            out = [t[-k:] for t in out]
        total = sum(len(t) for t in out)
        if total > MAX_REQUEST_TOKENS:
            raise InvalidRequestError(f"the inputs have {total} tokens; at most "
                                      f"{MAX_REQUEST_TOKENS} per request (OpenAI's limit): "
                                      "send them in several requests", param=param)
        return out

    async def pooled(self, model: str | None, inputs: Callable[[], Sequence[str | list[int]]],
                     size: int, param: str = "input", truncate: bool = False,
                     scores: bool = False, keep: int | None = None
                     ) -> tuple[list[np.ndarray], int]:
        """The pooled vectors of what ``inputs`` lists (strings are tokenized with BOS; run
        off the event loop when ``size`` is large), not normalised, and their token count;
        a request for a LoRA adapter or another model is refused first. An input longer than
        the embeddings hold is a 400, or with ``truncate`` its end is cut. ``scores``: a
        reranker's (token ids laid out by ``rerank_tokens``); a reranker makes nothing else,
        and only a reranker makes them."""
        if adapter(self.aengine, model) is not None:  # listed in /v1/models: not a 404
            raise no_adapter_embeddings(model or "", self.model_id)
        check_model(model, self.model_id)
        if (self.aengine.pooling == "rank") != scores:
            raise InvalidRequestError(RERANKER_ONLY if not scores else NOT_A_RERANKER,
                                      param="model")
        start = time.perf_counter()
        token_lists = await self.aengine.off_loop(
            size, lambda: self._tokens(inputs(), param, truncate, keep))
        limit = self.aengine.embedding_limit
        longest = max(map(len, token_lists), default=0)
        if longest > limit:
            what = "a (query, document) pair" if scores else "an input"
            raise InvalidRequestError(f"{what} has {longest} tokens; the model takes at most "
                                      f"{limit}", param=param)
        try:
            vectors = await self.aengine.embed(token_lists)
        except asyncio.CancelledError:  # its client left (unless_disconnected): vLLM's abort
            if self.metrics is not None:
                self.metrics.observe_aborted(start)
            raise
        n = sum(len(t) for t in token_lists)
        if self.metrics is not None:
            self.metrics.observe_embeddings(n, time.perf_counter() - start)
        return vectors, n

    async def create(self, data: EmbeddingRequest, truncate: bool = False,
                     normalise: bool = True) -> EmbeddingList:
        """``/v1/embeddings``' answer (``truncate``: Ollama's, for its routes; ``normalise``
        False: the pooled vectors as they are, as Ollama's older ``/api/embeddings`` gives
        them)."""
        if data.user:  # logged, as the chat routes log theirs (--verbose)
            log.info("embeddings: user=%s", data.user)
        size = self.aengine.engine.backend.n_embd
        if data.dimensions is not None and not 0 < data.dimensions <= size:
            raise InvalidRequestError(f"dimensions must be in [1, {size}]",  # (before the work)
                                      param="dimensions")
        pooled, n = await self.pooled(data.model, lambda: prompt_list(data.input, "input"),
                                      text_size(data.input), truncate=truncate,
                                      keep=data.truncate_prompt_tokens)
        vectors = [normalised(v) for v in pooled] if normalise else pooled
        if data.dimensions is not None:
            vectors = [v[:data.dimensions] / (np.linalg.norm(v[:data.dimensions]) or 1.0)
                       for v in vectors]
        items = []
        for i, v in enumerate(vectors):
            emb: list[float] | str = (base64.b64encode(v.astype(np.float32).tobytes()).decode()
                                      if data.encoding_format == "base64" else v.tolist())
            items.append(Embedding("embedding", i, emb))
        return EmbeddingList("list", items, self.model_id, EmbeddingUsage(n, n))
