"""Speculative decoding through the server: per-request control and /metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import start_server
from tests.server.test_openai_api import metric

REPEATING = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
             "def mul(a, b):\n    return a * b\n\ndef add(a, b):\n")


@pytest.fixture(scope="module")
def spec_server(model_path):
    s = start_server(model_path, "--spec", "ngram", "--gamma", "4", "--max-seqs", "4",
                     "--pool-blocks", "128")
    yield s
    assert s.stop() == 0


def complete(server, **extra) -> httpx.Response:
    body = {"prompt": REPEATING, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def test_speculation_shows_in_metrics_and_can_be_turned_off_per_request(spec_server):
    drafts0 = metric(spec_server, "vllm:spec_decode_num_drafts_total")
    r = complete(spec_server)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 24
    drafts1 = metric(spec_server, "vllm:spec_decode_num_drafts_total")
    accepted = metric(spec_server, "vllm:spec_decode_num_accepted_tokens_total")
    drafted = metric(spec_server, "vllm:spec_decode_num_draft_tokens_total")
    assert drafts1 > drafts0 and 0 < accepted <= drafted
    assert 0 < metric(spec_server, "justllm_spec_decode_acceptance_rate") <= 1

    off = complete(spec_server, **{"speculative.n_max": 0})
    assert off.status_code == 200, off.text
    assert off.json()["usage"]["completion_tokens"] == 24
    assert metric(spec_server, "vllm:spec_decode_num_drafts_total") == drafts1
    # same greedy text either way (up to batch-shape noise, which one request alone avoids
    # except at a near tie; this prompt has none in its first 24 tokens)
    assert off.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]


@pytest.mark.parametrize("field,value", [("speculative.n_max", -1), ("speculative.n_max", 99),
                                         ("speculative.p_min", 1.5),
                                         ("speculative.n_max", 5),  # above --gamma 4
                                         ("speculative.p_min", 0.5)])  # n-gram: no cut-off
def test_bad_speculation_fields_are_400(spec_server, field, value):
    r = complete(spec_server, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error"


def test_speculation_fields_on_a_server_without_speculation(server):
    """They were accepted and ignored; 0 (no drafts) is what such a server does anyway."""
    for field, value in (("speculative.n_max", 3), ("speculative.p_min", 0.3)):
        r = complete(server, **{field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "--spec" in r.json()["error"]["message"]
    assert complete(server, **{"speculative.n_max": 0, "max_tokens": 2}).status_code == 200


def test_llama_servers_own_route_takes_its_speculation_fields(spec_server):
    """/completion refused speculative.n_max and .p_min (unknown fields), though they are
    llama-server's names and the OpenAI routes take them."""
    def native(**extra) -> httpx.Response:
        return httpx.post(spec_server.url + "/completion", timeout=120, json={
            "prompt": REPEATING, "n_predict": 24, "temperature": 0, "ignore_eos": True,
            **extra})

    drafts = metric(spec_server, "vllm:spec_decode_num_drafts_total")
    off = native(**{"speculative.n_max": 0})
    assert off.status_code == 200 and off.json()["tokens_predicted"] == 24, off.text
    assert metric(spec_server, "vllm:spec_decode_num_drafts_total") == drafts  # honoured
    on = native(**{"speculative.n_max": 4})
    assert on.status_code == 200 and on.json()["content"] == off.json()["content"], on.text
    assert metric(spec_server, "vllm:spec_decode_num_drafts_total") > drafts
    r = native(**{"speculative.p_min": 0.5})  # n-gram drafts take no cut-off
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.p_min", r.text


def test_inter_token_latency_is_observed_once_per_step_as_in_vllm(spec_server):
    """vLLM observes a request's inter-token latency once per engine step that gave it
    tokens: the tokens a verified draft adds come in the step's one piece. Each was observed
    with a gap of 0 after the first, so a well-speculating server's ITL read near zero."""
    from tests.server.test_openai_api import metric_in

    names = ("vllm:inter_token_latency_seconds_count", "vllm:generation_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total")

    def counts() -> list[float]:
        text = httpx.get(spec_server.url + "/metrics", timeout=60).text
        return [metric_in(text, n) for n in names]

    complete(spec_server, max_tokens=2)  # (every series on the page)
    before = counts()
    r = complete(spec_server)
    assert r.status_code == 200, r.text
    itl, generated, accepted = (b - a for a, b in zip(before, counts()))
    assert generated == 24 and accepted > 0
    # the first token, then one step per draft walked: its accepted tokens and one more,
    # but the last step's, which max_tokens may end among its accepted tokens
    assert generated - 1 - accepted <= itl <= generated - accepted
