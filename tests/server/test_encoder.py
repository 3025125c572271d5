"""An encoder (a BERT sentence-embedding model) served: embeddings as llama.cpp makes them,
and every route that writes text refused in its API's shape, as vLLM refuses a pooling model
and Ollama an embedding model. The model is a two-layer BERT with random weights written as
llama.cpp's converter writes one (tests/models/ggufs.py: tiny_bert)."""

from __future__ import annotations

import numpy as np
import pytest

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
    assert "transcript" not in s.proc.stdout.read().decode()  # no chat notice for an encoder


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
