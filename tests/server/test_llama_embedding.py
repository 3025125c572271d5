"""llama-server's native ``POST /embedding`` and ``/embeddings`` on a real server: its prompt
forms, ``embd_normalize`` as llama.cpp's ``common_embd_normalize``, its answer's shape, and a
400 for every field it would ignore."""

from __future__ import annotations

import math

import numpy as np
import pytest

from justllm.server.embeddings import MAX_INPUTS, MAX_REQUEST_TOKENS, normalised
from tests.models.ggufs import with_metadata, with_pooling
from tests.server.conftest import start_server
from tests.server.test_tokenize import post, tokenize


def vectors(server, path: str = "/embedding", **body) -> list[np.ndarray]:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [e["index"] for e in answer] == list(range(len(answer)))
    assert all(len(e["embedding"]) == 1 for e in answer)  # one pooled vector, in a list
    return [np.array(e["embedding"][0]) for e in answer]


def refused(server, param: str, status: int = 400, **body) -> str:
    r = post(server, "/embedding", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
    return r.json()["error"]["message"]


def test_the_pooled_vector_is_openais_before_its_normalisation(server):
    oai = post(server, "/v1/embeddings", {"input": "hello world"}).json()["data"][0]["embedding"]
    [unit] = vectors(server, content="hello world")
    assert np.allclose(unit, oai, atol=1e-6)
    [same] = vectors(server, "/embeddings", input="hello world")
    assert np.allclose(same, unit, atol=1e-6)
    [unset] = vectors(server, content="hello world", embd_normalize=None)  # the default
    assert np.allclose(unset, unit, atol=1e-6)
    [raw] = vectors(server, content="hello world", embd_normalize=-1)
    assert np.linalg.norm(raw) > 2  # not normalised: this model's pooled vectors are longer
    assert np.allclose(raw / np.linalg.norm(raw), unit, atol=1e-6)
    [int16] = vectors(server, content="hello world", embd_normalize=0)
    assert math.isclose(np.abs(int16).max(), 32760, rel_tol=1e-6)
    assert np.allclose(int16, raw * (32760 / np.abs(raw).max()), rtol=1e-5)
    for p in (1, 3, 5):
        [v] = vectors(server, content="hello world", embd_normalize=p)
        assert math.isclose(float((np.abs(v) ** p).sum() ** (1 / p)), 1.0, rel_tol=1e-5)
        assert np.allclose(v / np.linalg.norm(v), unit, atol=1e-6)


def test_llama_servers_prompt_forms_one_vector_each_in_order(server):
    x = tokenize(server, prompt="x")["tokens"]  # with BOS
    y = tokenize(server, content="y", add_special=False)["tokens"]
    bos = tokenize(server, prompt="")["tokens"]
    got = vectors(server, input=["x", ["x", 12, 13, "y"], {"prompt_string": "x"}, "",
                                 x + [12, 13] + y, bos])
    assert len(got) == 6
    assert np.allclose(got[0], got[2], atol=1e-6)  # the object form is its string
    assert np.allclose(got[1], got[4], atol=1e-6)  # mixed: BOS before the first string alone
    assert np.allclose(got[3], got[5], atol=1e-6)  # an empty string is BOS alone
    assert not np.allclose(got[0], got[1], atol=1e-3)
    # token ids alone are one prompt, not one per id
    assert len(vectors(server, input=x + [12])) == 1


def test_fields_it_would_ignore_and_bad_inputs_are_400s(server):
    assert "not both" in refused(server, "content", input="a", content="b")
    assert "must be provided" in refused(server, "input", embd_normalize=2)
    assert "base64" in refused(server, "encoding_format", input="a", encoding_format="base64")
    refused(server, "embd_normalize", input="a", embd_normalize=-2)
    refused(server, "embd_normalize", input="a", embd_normalize=True)  # strictly an integer
    refused(server, "pooling", input="a", pooling="none")  # not a field: refused, not ignored
    refused(server, "input", input=[])
    refused(server, "input", input=[None])
    refused(server, "content", content=[10**9])
    refused(server, "input.multimodal_data", input={"prompt_string": "a",
                                                    "multimodal_data": ["AA=="]})
    assert str(MAX_INPUTS) in refused(server, "input", input=["a"] * (MAX_INPUTS + 1))
    assert MAX_INPUTS == 2048  # OpenAI's (it was 256: LangChain sends 1,000 texts at a time)
    # and OpenAI's bound on a request's tokens, checked before any is computed
    assert f"at most {MAX_REQUEST_TOKENS} per request" in refused(
        server, "input", input=[[5] * 2048] * (MAX_REQUEST_TOKENS // 2048 + 1))
    assert "at most" in refused(server, "input", input=[5] * 3000)  # past the context
    refused(server, "model", status=404, input="a", model="nope")
    assert len(vectors(server, input="a", model=server.model)) == 1


@pytest.mark.parametrize("norm", [-1, 0, 1, 2, 3, 7])
def test_normalised_is_llama_cpps_common_embd_normalize(norm):
    rng = np.random.default_rng(norm + 2)
    v = rng.normal(size=640).astype(np.float32) * 4
    x = v.astype(np.float64)  # llama.cpp sums in double, then scales each float
    if norm == -1:
        size = 1.0
    elif norm == 0:
        size = np.abs(x).max() / 32760.0
    elif norm == 2:
        size = math.sqrt(sum(t * t for t in x))
    else:
        size = sum(abs(t) ** norm for t in x) ** (1.0 / norm)
    assert np.allclose(normalised(v, norm), v * (1.0 / size), rtol=1e-6)
    assert not normalised(np.zeros(4, dtype=np.float32), norm).any()  # a zero vector stays 0


@pytest.fixture(scope="module")
def cls_model(model_path, tmp_path_factory):
    """The demo model's weights, its GGUF naming CLS pooling, as BGE's does."""
    return str(with_pooling(model_path, tmp_path_factory.mktemp("pool") / "cls.gguf", 2))


def test_embeddings_pool_as_the_model_says_or_as_pooling_says(cls_model):
    """CLS pooling is the first token's state; this model is causal and every input starts
    with BOS, so every input gets BOS's state, which is also what last-token pooling gives
    BOS alone. Mean pooling of the same model tells inputs apart."""
    def pooled(server, *texts: str) -> list[np.ndarray]:
        return vectors(server, input=list(texts), embd_normalize=-1)

    own = start_server(cls_model)
    try:
        a, bcd = pooled(own, "a", "b c d")
        assert np.allclose(a, bcd, atol=1e-5)  # the model's own pooling: CLS
        oai = post(own, "/v1/embeddings", {"input": ["a", "b c d"]}).json()["data"]
        assert np.allclose(oai[0]["embedding"], oai[1]["embedding"], atol=1e-6)
    finally:
        assert own.stop() == 0
    last = start_server(cls_model, "--pooling", "last")
    try:
        bos, bcd_last = pooled(last, "", "b c d")
        assert np.allclose(bos, a, atol=1e-4)  # the last of BOS alone is BOS's state
        assert not np.allclose(bcd_last, a, atol=1e-2)
    finally:
        assert last.stop() == 0
    mean = start_server(cls_model, "--pooling", "mean")
    try:
        a_mean, bcd_mean = pooled(mean, "a", "b c d")
        assert not np.allclose(a_mean, bcd_mean, atol=1e-2)
    finally:
        assert mean.stop() == 0


def test_an_input_longer_than_the_training_context_is_refused(model_path, tmp_path):
    """Embeddings hold at most the model's training context (here named 64 tokens): past it a
    model with learned positions has none, so llama.cpp would read out of its table."""
    short = with_metadata(model_path, tmp_path / "short.gguf",
                          lambda w, arch: None, edit=lambda name, value, _: (
                              64 if name.endswith(".context_length") else value))
    s = start_server(str(short), "--ctx", "64", "--pool-blocks", "8")
    try:
        assert len(vectors(s, input=[5] * 64)) == 1
        assert "at most 64" in refused(s, "input", input=[5] * 65)
    finally:
        assert s.stop() == 0
