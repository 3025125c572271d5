"""Reranking: ``POST /v1/rerank`` (and llama-server's ``/rerank``, ``/reranking``,
``/v1/reranking``), as llama-server serves it with ``--reranking``, in Jina's and Cohere's
shape (``documents``; vLLM's too) or Text Embeddings Inference's (``texts``).

A reranker is a cross-encoder (bge-reranker, jina-reranker...) whose GGUF pools by rank: each
(query, document) pair, laid out as llama-server lays it out (``rerank_tokens``), goes
through the model once and its classifier head gives the pair's score, llama.cpp's raw score
as llama-server returns it (no sigmoid). Results come sorted by score, best first, cut at
``top_n``. A model that is not a reranker answers a 400 (llama-server: 501).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec
from litestar import Request, Response, post
from litestar.datastructures import State
from litestar.params import JSONBody
from msgspec import Meta

from justllm.errors import InvalidRequestError
from justllm.server.app import decode_request, embedding_serving, unless_disconnected


class DocumentObject(msgspec.Struct, forbid_unknown_fields=True):
    """A document as Jina and Cohere also take it: ``{"text": ...}``."""

    text: str


class RerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None  # the served model when absent
    query: str
    documents: list[Union[str, DocumentObject]] | None = None  # Jina's, Cohere's, vLLM's
    texts: list[str] | None = None  # Text Embeddings Inference's (its answer's shape too)
    top_n: Annotated[int, Meta(ge=1)] | None = None
    return_documents: bool = False  # Jina's, Cohere's: each result's document
    return_text: bool = False  # TEI's: each result's text
    truncate: bool | None = None  # TEI's: only false (a pair too long is a 400)


def rerank_texts(req: RerankRequest) -> tuple[list[str], bool]:
    """The documents' texts, and whether the request is in TEI's shape."""
    if (req.documents is None) == (req.texts is None):
        raise InvalidRequestError("give the documents as documents (or as TEI's texts), one "
                                  "of the two", param="documents")
    if req.texts is not None:
        if req.return_documents:
            raise InvalidRequestError("return_documents: with texts (TEI's shape) send "
                                      "return_text", param="return_documents")
        texts, tei = req.texts, True
    else:
        if req.return_text:
            raise InvalidRequestError("return_text: with documents send return_documents",
                                      param="return_text")
        assert req.documents is not None
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        tei = False
    if not texts:
        raise InvalidRequestError("documents must not be empty",
                                  param="texts" if tei else "documents")
    if req.truncate:
        raise InvalidRequestError("truncate: a (query, document) pair longer than the model "
                                  "holds is refused, not cut", param="truncate")
    return texts, tei


@post(["/v1/rerank", "/v1/reranking", "/rerank", "/reranking"], status_code=200,
      summary="Rerank documents by their relevance to a query (a reranker model)")
async def rerank(data: JSONBody[RerankRequest], request: Request, state: State) -> Any:
    served, serving = embedding_serving(state)
    req = await decode_request(request, RerankRequest)
    texts, tei = rerank_texts(req)
    aengine = served.aengine
    done = await unless_disconnected(request, serving.pooled(
        req.model, lambda: [aengine.rerank_tokens(req.query, t) for t in texts],
        len(req.query) * len(texts) + sum(map(len, texts)),
        param="texts" if tei else "documents", scores=True))
    if isinstance(done, Response):
        return done
    scores, n = done
    ranked = sorted(range(len(texts)), key=lambda i: -float(scores[i][0]))[:req.top_n]
    if tei:
        return [{"index": i, "score": float(scores[i][0]),
                 **({"text": texts[i]} if req.return_text else {})} for i in ranked]
    results = [{"index": i, "relevance_score": float(scores[i][0]),
                **({"document": {"text": texts[i]}} if req.return_documents else {})}
               for i in ranked]
    return {"model": req.model or served.model_id, "object": "list",
            "usage": {"prompt_tokens": n, "total_tokens": n}, "results": results}
