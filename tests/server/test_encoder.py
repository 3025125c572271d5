"""An encoder (a BERT sentence-embedding model) served: embeddings as llama.cpp makes them,
and every route that writes text refused in its API's shape, as vLLM refuses a pooling model
and Ollama an embedding model. The model is a two-layer BERT with random weights written as
llama.cpp's converter writes one (tests/models/ggufs.py: tiny_bert)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import llama_cpps_pooling
from tests.models.ggufs import tiny_bert
from tests.server.conftest import start_server
from tests.server.test_tokenize import post


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    path = tiny_bert(tmp_path_factory.mktemp("bert") / "tiny-bert.gguf")
    s = start_server(str(path), "--max-seqs", "2", "--pool-blocks", "16")
    s.path = path  # type: ignore[attr-defined]
    yield s
    assert s.stop() == 0
    assert "transcript" not in s.output()  # no chat notice for an encoder


def test_embeddings_are_llama_cpps_own(bert):
    from llama_cpp import Llama  # (the test compares with llama.cpp through its bindings)

    texts = ["hello world", "the cat sat on the mat", "paris is the capital of france"]
    got = post(bert, "/v1/embeddings", {"input": texts}).json()["data"]
    ref = Llama(str(bert.path), embedding=True, verbose=False)
    for text, item in zip(texts, got):
        want = np.asarray(ref.embed(text), dtype=np.float64)  # mean-pooled, as the GGUF says
        mine = np.asarray(item["embedding"])
        assert mine.shape == want.shape == (64,)
        cosine = mine @ want / np.linalg.norm(want)
        assert cosine > 0.99999 and abs(np.linalg.norm(mine) - 1) < 1e-6
    ollama = post(bert, "/api/embed", {"model": bert.model, "input": texts[0]}).json()
    assert np.allclose(ollama["embeddings"][0], got[0]["embedding"], atol=1e-6)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello world", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
    ("/v1/responses", {"input": "hello"}),
    ("/completion", {"prompt": "hello", "n_predict": 0}),  # (not even a warm-up)
])
def test_what_writes_text_is_refused(bert, path, body):
    r = post(bert, path, body)
    assert r.status_code == 400, r.text
    assert "embeddings only" in r.json()["error"]["message"]


def test_anthropic_and_ollama_refuse_in_their_shapes(bert):
    r = post(bert, "/v1/messages", {"model": bert.model, "max_tokens": 4,
                                    "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "embeddings only" in r.json()["error"]["message"]
    for path, body, what in [
            ("/api/generate", {"prompt": "hello"}, "generate"),
            ("/api/chat", {"messages": [{"role": "user", "content": "hello"}]}, "chat")]:
        r = post(bert, path, {"model": bert.model, **body})
        assert r.status_code == 400
        assert r.json() == {"error": f'"{bert.model}" does not support {what}'}
    show = post(bert, "/api/show", {"model": bert.model}).json()
    assert show["capabilities"] == ["embedding"]
    assert httpx_ok(bert)


def httpx_ok(server) -> bool:
    """The server still answers (nothing above harmed it)."""
    return post(server, "/v1/embeddings", {"input": "hello"}).status_code == 200


def test_justllm_run_says_so_in_one_line(bert):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "justllm", "run", str(bert.path), "hello"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "embeddings only" in errors[0], done.stderr
    assert "Traceback" not in done.stderr


# ---- a reranker ------------------------------------------------------------------------------

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat on the mat", "red apple",
        "hello world what is this", "green river stone light"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = tiny_bert(tmp_path_factory.mktemp("rerank") / "tiny-reranker.gguf", reranker=True)
    s = start_server(str(path), "--max-seqs", "2", "--pool-blocks", "16")
    s.path = path  # type: ignore[attr-defined]
    yield s
    assert s.stop() == 0


def llama_cpp_scores(path, pairs: list[list[int]]) -> list[float]:
    """Each token sequence's score from llama.cpp itself: a rank-pooled context (what
    llama-server's --reranking reads: the pooled sequence's first value)."""
    import llama_cpp as C

    return [float(v[0]) for v in llama_cpps_pooling(path, pairs, C.LLAMA_POOLING_TYPE_RANK,
                                                     n_ctx=128)]


def test_rerank_scores_are_llama_cpps_and_sorted(reranker):
    r = post(reranker, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    # [CLS] query [SEP] [SEP] document [SEP], as llama-server lays a pair out for a BERT
    cls, sep = 2, 3
    words = {t: post(reranker, "/tokenize", {"content": t, "add_special": False}).json()[
        "tokens"] for t in [QUERY, *DOCS]}
    laid = [[cls, *words[QUERY], sep, sep, *words[d], sep] for d in DOCS]
    assert body["usage"]["prompt_tokens"] == sum(map(len, laid))
    want = llama_cpp_scores(reranker.path, laid)
    got = {x["index"]: x["relevance_score"] for x in results}
    assert [got[i] for i in range(len(DOCS))] == pytest.approx(want, abs=1e-5)


def test_rerank_shapes(reranker):
    jina = post(reranker, "/rerank", {"query": QUERY, "documents": [
        DOCS[0], {"text": DOCS[1]}], "top_n": 1, "return_documents": True}).json()
    assert len(jina["results"]) == 1 and jina["object"] == "list"
    best = jina["results"][0]
    assert best["document"] == {"text": DOCS[best["index"]]}
    tei = post(reranker, "/reranking", {"query": QUERY, "texts": DOCS[:2],
                                        "return_text": True}).json()
    assert {x["index"]: x["text"] for x in tei} == {0: DOCS[0], 1: DOCS[1]}
    assert tei[0]["score"] >= tei[1]["score"]
    v1 = post(reranker, "/v1/reranking", {"query": QUERY, "documents": DOCS[:2]}).json()
    assert [x["index"] for x in v1["results"]] == [x["index"] for x in tei]


@pytest.mark.parametrize("body, param", [
    ({"query": QUERY}, "documents"),
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": ["a"], "texts": ["a"]}, "documents"),
    ({"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
    ({"query": QUERY, "texts": ["a"], "return_documents": True}, "return_documents"),
    ({"query": QUERY, "documents": ["a"], "truncate": True}, "truncate"),
    ({"query": QUERY, "documents": ["a"], "model": "nope"}, "model"),
    ({"query": QUERY, "documents": ["a"], "colour": "red"}, "colour"),
    ({"query": QUERY, "documents": ["hello " * 200]}, "documents"),  # past what it holds
])
def test_bad_rerank_requests(reranker, body, param):
    r = post(reranker, "/v1/rerank", body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_reranker_makes_no_embeddings_and_others_do_not_rerank(reranker, bert):
    r = post(reranker, "/v1/embeddings", {"input": "hello"})
    assert r.status_code == 400 and "is a reranker" in r.json()["error"]["message"]
    r = post(reranker, "/api/embed", {"model": reranker.model, "input": "hello"})
    assert r.status_code == 400 and "is a reranker" in r.json()["error"]
    show = post(reranker, "/api/show", {"model": reranker.model}).json()
    assert show["capabilities"] == []  # (no embeddings, no text: Ollama has no "rerank")
    r = post(bert, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert r.status_code == 400 and "not a reranker" in r.json()["error"]["message"]
