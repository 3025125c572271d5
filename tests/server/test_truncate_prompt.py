"""vLLM's ``truncate_prompt_tokens`` on completions, chat and embeddings: only the prompt's
last k tokens are read (-1: as many as the model holds), on a real server."""

from __future__ import annotations

import numpy as np

from tests.server.test_tokenize import post

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"


def ids(server, text: str, special: bool = True) -> list[int]:
    return post(server, "/tokenize", {"prompt": text, "add_special_tokens": special}).json()[
        "tokens"]


def test_a_completion_reads_only_the_last_tokens(server):
    whole = ids(server, PROMPT)
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                                         "truncate_prompt_tokens": 6, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["prompt_tokens"] == 6
    # the scored prompt is the last six tokens (BOS gone, as in vLLM)
    scored = [int(next(iter(e))) for e in choice["prompt_logprobs"][1:]]
    assert scored == whole[-5:]
    again = post(server, "/v1/completions", {"prompt": whole[-6:], "max_tokens": 1,
                                             "temperature": 0, "prompt_logprobs": 0}).json()
    assert again["choices"][0]["prompt_logprobs"] == choice["prompt_logprobs"]
    r = post(server, "/v1/completions", {"prompt": [whole, whole[:4]], "max_tokens": 1,
                                         "truncate_prompt_tokens": 5})
    assert r.json()["usage"]["prompt_tokens"] == 5 + 4  # (a shorter prompt is kept whole)


def test_a_chat_reads_only_the_last_tokens_of_its_rendered_prompt(server):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    whole = post(server, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"]
    cut = post(server, "/v1/chat/completions", {**body, "truncate_prompt_tokens": 7})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 7 < whole


def test_embeddings_of_the_last_tokens(server):
    whole = ids(server, PROMPT)
    cut = post(server, "/v1/embeddings", {"input": PROMPT, "truncate_prompt_tokens": 5}).json()
    direct = post(server, "/v1/embeddings", {"input": [whole[-5:]]}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    assert np.allclose(cut["data"][0]["embedding"], direct["data"][0]["embedding"], atol=1e-6)
    long = "word " * 3000  # past the 2,048 tokens an embedding holds
    r = post(server, "/v1/embeddings", {"input": long})
    assert r.status_code == 400
    r = post(server, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2048
    # A causal model's input goes through in chunks (engine/backend.py EmbeddingContext): in
    # one batch llama.cpp kept a row of logits over the 262k vocabulary for every token, and
    # this server's memory peaked at 4.7 GiB with that embedding; chunked, 1.7 GiB, and with
    # the hidden states taken before the language-model head, 1.2 GiB.
    assert peak_memory_gib(server.proc.pid) < 2.5


def test_refused(server):
    for path, body in [
            ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 0}),
            ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 3, "echo": True}),
            ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": -2}),
            ("/v1/embeddings", {"input": PROMPT, "truncate_prompt_tokens": 0}),
            # more than an input holds (vLLM's 400; it was taken, cutting nothing)
            ("/v1/embeddings", {"input": PROMPT, "truncate_prompt_tokens": 5000})]:
        r = post(server, path, body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def peak_memory_gib(pid: int) -> float:
    """A process's peak resident memory (Linux's ``VmHWM``)."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 2**20
