"""Plugins in a real ``justllm serve`` and a real engine: a model source, a speculation
method, routes, and on_request_finished records (the sample plugin in ``site/``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Engine
from justllm.plugins import load_plugins
from tests.helpers import default_sigint, divergence_is_noise, run_alone
from tests.lora_files import write_adapter
from tests.plugins.test_loading import SITE
from tests.server.conftest import start_server

PERIODIC = "1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5)


@pytest.fixture
def sample(monkeypatch):
    monkeypatch.syspath_prepend(str(SITE))
    yield load_plugins({"JUSTLLM_PLUGINS": "justllm-sample"})


@pytest.mark.model
def test_a_plugin_speculation_method_is_lossless_and_its_drafts_are_accepted(sample, engine,
                                                                          model_path):
    with pytest.raises(ValueError, match="spec must be one of ngram, draft, tree "):
        EngineConfig(model=model_path, spec="period")  # without the plugin's table
    spec = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=128, spec="period",
                               spec_methods=sample.spec_methods))
    try:
        ref, ref_lp = run_alone(engine, PERIODIC, GREEDY)
        got, got_lp = run_alone(spec, PERIODIC, GREEDY)
        stats = spec.stats().spec
    finally:
        spec.close()
    ok, why = divergence_is_noise(ref, ref_lp, got, got_lp)
    assert ok, why
    assert len(got) == 24
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.model
def test_serve_with_a_plugin_source_spec_method_route_and_request_records(tmp_path, engine):
    records = tmp_path / "records.jsonl"
    env = {"PYTHONPATH": str(SITE), "JUSTLLM_PLUGINS": "justllm-sample",
           "JUSTLLM_SAMPLE_RECORDS": str(records)}
    server = start_server("sample:demo", "--spec", "period", "--api-key", "k", "--record-text",
                          "--max-seqs", "4", "--pool-blocks", "128", env=env)
    auth = {"Authorization": "Bearer k"}
    try:
        assert server.model == "demo"  # the source's served_name, not the file's stem
        # The plugin's route: behind --api-key like /v1, with the loaded model.
        url = server.url + "/v1/sample/tokenize"
        assert httpx.post(url, json={"text": "Hello world"}).status_code == 401
        r = httpx.post(url, json={"text": "Hello world"}, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json() == {"model": "demo", "tokens": engine.tokenize("Hello world")}
        answers = []
        traced = {**auth, "traceparent": TRACEPARENT}  # the first request's client traces it
        for prompt, headers in ((PERIODIC, traced), ("The capital of France is", auth)):
            r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=120, json={
                "model": "demo", "prompt": prompt, "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            answers.append(r.json())
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        accepted = re.search(r"^vllm:spec_decode_num_accepted_tokens_total\{.*\} (\S+)$",
                             metrics, re.M)
        assert accepted and float(accepted.group(1)) > 0  # the plugin's proposer drafted
    finally:
        assert server.stop() == 0
    # Every request's record reached the plugin before the server exited.
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    assert [x["finish_reason"] for x in lines] == ["length", "length"]
    for rec, answer, prompt in zip(lines, answers, (PERIODIC, "The capital of France is")):
        assert rec["request_id"] == answer["id"] and answer["id"].startswith("cmpl-")
        assert rec["model"] == "demo"
        assert rec["prompt_tokens"] == answer["usage"]["prompt_tokens"]
        assert rec["completion_tokens"] == answer["usage"]["completion_tokens"] == 12
        assert rec["prompt"] == prompt and rec["output"] == answer["choices"][0]["text"]
        assert rec["params"] == {"max_tokens": 12, "temperature": 0.0}
        assert rec["queued_seconds"] >= 0 and rec["prefill_seconds"] > 0
        assert rec["decode_seconds"] > 0
        assert rec["total_seconds"] == pytest.approx(
            rec["queued_seconds"] + rec["prefill_seconds"] + rec["decode_seconds"], abs=1e-6)
        assert rec["api"] == "openai.completions" and rec["stream"] is False
    assert [rec["traceparent"] for rec in lines] == [TRACEPARENT, None]


@pytest.mark.model
def test_a_request_that_names_an_adapter_as_its_model_is_recorded_under_its_name(
        tmp_path, model_path):
    # (records named the base model: ``justllm history --model ADAPTER`` found nothing)
    records = tmp_path / "records.jsonl"
    env = {"PYTHONPATH": str(SITE), "JUSTLLM_PLUGINS": "justllm-sample",
           "JUSTLLM_SAMPLE_RECORDS": str(records)}
    adapter = write_adapter(tmp_path / "pirate.gguf", seed=5)
    server = start_server(model_path, "--lora", f"pirate={adapter}", "--max-seqs", "2",
                          "--pool-blocks", "64", env=env)
    asked = [("/v1/completions", {"model": "pirate", "prompt": "Hi", "max_tokens": 2}),
             ("/v1/chat/completions", {"model": "pirate", "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "Hi"}]}),
             ("/completion", {"model": "pirate", "prompt": "Hi", "n_predict": 2}),
             ("/api/generate", {"model": "pirate:latest", "prompt": "Hi", "stream": False,
                                "options": {"num_predict": 2}}),
             ("/v1/messages", {"model": "pirate", "max_tokens": 2,
                               "messages": [{"role": "user", "content": "Hi"}]}),
             # the lora field alone: the answer (and the record) names the base model
             ("/v1/completions", {"model": server.model, "prompt": "Hi", "max_tokens": 2,
                                  "lora": [{"name": "pirate"}]}),
             # an answer its line limits end: length, as the answer's own stop_type (the
             # record said abort)
             ("/completion", {"model": "pirate", "prompt": "1\n2\n3\n", "n_predict": 40,
                              "t_max_predict_ms": 1, "ignore_eos": True, "temperature": 0})]
    try:
        for route, body in asked:
            r = httpx.post(server.url + route, json=body, timeout=120)
            assert r.status_code == 200, (route, r.text)
    finally:
        assert server.stop() == 0
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    assert [(x["model"], x["lora"]) for x in lines] == [("pirate", "pirate")] * 5 + [
        (server.model, "pirate"), ("pirate", "pirate")]
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["completion_tokens"] < 40


def sample_cli(tmp_path, *args: str, **kwargs) -> subprocess.Popen:
    """``justllm ARGS`` with the sample plugin writing its records to records.jsonl; Ctrl-C
    raises KeyboardInterrupt in it even where this test's own SIGINT is ignored (a background
    job's)."""
    env = {**os.environ, "PYTHONPATH": str(SITE), "JUSTLLM_PLUGINS": "justllm-sample",
           "JUSTLLM_SAMPLE_RECORDS": str(tmp_path / "records.jsonl")}
    return subprocess.Popen([sys.executable, "-m", "justllm", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=default_sigint,
                            **kwargs)


def sample_records(tmp_path) -> list[dict]:
    path = tmp_path / "records.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.model
def test_run_and_chat_records_name_the_model_as_its_source_names_it(tmp_path):
    """``justllm run sample:demo`` (as ``run ollama:llama3.2``) is recorded as the model
    ``serve`` would answer to, ``demo``, not as the file's stem (an Ollama blob's is
    ``sha256-...``)."""
    run = sample_cli(tmp_path, "run", "sample:demo", "-p", "Hi", "--raw", "-n", "2",
                     "--pool-blocks", "64")
    chat = sample_cli(tmp_path, "chat", "sample:demo", "-n", "2", "--pool-blocks", "64",
                      stdin=subprocess.PIPE)
    for proc, stdin in ((run, None), (chat, "Hello\n")):
        out, err = proc.communicate(stdin, timeout=120)
        assert proc.returncode == 0, err
    records = sample_records(tmp_path)
    assert sorted(r["request_id"].split("-")[0] for r in records) == ["chat", "run"]
    assert [r["model"] for r in records] == ["demo", "demo"]


@pytest.mark.model
def test_an_interrupted_run_is_recorded_as_aborted(tmp_path):
    """Ctrl-C during ``justllm run``: the request left the engine, aborted by its user, and
    its record says so (there was none)."""
    proc = sample_cli(tmp_path, "run", "sample:demo", "-p", "Count:", "--raw", "-n", "900",
                      "--ignore-eos", "--pool-blocks", "64")
    try:
        assert proc.stdout.read(1)  # it generates
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    (record,) = sample_records(tmp_path)
    assert record["request_id"].startswith("run-") and record["finish_reason"] == "abort"
    assert 1 <= record["completion_tokens"] < 900


def test_a_plugin_record_counts_are_on_metrics_and_text_is_off_by_default(tmp_path):
    records = tmp_path / "records.jsonl"
    env = {"PYTHONPATH": str(SITE), "JUSTLLM_PLUGINS": "justllm-sample",
           "JUSTLLM_SAMPLE_RECORDS": str(records)}
    server = start_server("sample:demo", "--max-seqs", "2", "--pool-blocks", "64", env=env)
    try:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                # ignore_eos: sampled, it could end on its own before the client leaves
                "prompt": "Once upon a time", "max_tokens": 200, "stream": True,
                "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # the client leaves after its first token
        # Seeded, ignoring EOS: both answers must run to max_tokens ("length" below), and a
        # sampled transcript answer may end early (EOS or "User:")
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2,
            "seed": 1, "ignore_eos": True})
        assert r.status_code == 200
        chat_id = r.json()["id"]
        deadline = time.monotonic() + 30  # the abort's record follows the client's leaving
        while len(records.read_text().splitlines() if records.exists() else []) < 3:
            assert time.monotonic() < deadline, "no record of the aborted request"
            time.sleep(0.05)
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        assert server.stop() == 0
    counts = {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'^justllm_plugin_request_records_total\{{model_name="{re.escape(server.model)}",outcome="(\w+)",'
        r'plugin="justllm-sample"\} '
        r'(\S+)$', metrics, re.M)}
    assert counts == {"delivered": 3.0, "failed": 0.0, "dropped": 0.0}
    lines = sorted((json.loads(x) for x in records.read_text().splitlines()),
                   key=lambda x: (x["finish_reason"], x["request_id"]))
    assert [x["finish_reason"] for x in lines] == ["abort", "length", "length"]
    assert chat_id.startswith("chatcmpl-")
    assert [x["request_id"] for x in lines[1:]] == [f"{chat_id}-0", f"{chat_id}-1"]  # n = 2
    assert all(x["prompt"] is None and x["output"] is None for x in lines)
    assert [(x["api"], x["stream"]) for x in lines] == [
        ("openai.completions", True), ("openai.chat", False), ("openai.chat", False)]
    assert 1 <= lines[0]["completion_tokens"] < 200
    assert os.path.getsize(records) > 0


@pytest.mark.model
def test_the_gateway_passes_trace_context_and_forwards_plugin_routes(tmp_path, model_path,
                                                                     engine):
    """Router mode: the runner's record carries the traceparent the client sent the gateway
    (a tracing plugin continues the client's trace from it), and the API it came through. A
    plugin's POST route reaches the runner of the body's model, with its path parameters and
    query string; an unknown model is the gateway's 404."""
    from tests.gateway.test_gateway import RUNNER_FLAGS, start_gateway, stop

    records = tmp_path / "records.jsonl"
    gw = start_gateway(tmp_path, {"demo": {"source": model_path, **RUNNER_FLAGS}}, env={
        "PYTHONPATH": str(SITE), "JUSTLLM_PLUGINS": "justllm-sample",
        "JUSTLLM_SAMPLE_RECORDS": str(records)})
    try:
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, headers={
            "traceparent": TRACEPARENT, "tracestate": "vendor=1"}, json={
            "model": "demo", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        url = gw.url + "/v1/sample/tokenize"
        t = httpx.post(url, timeout=60, json={"model": "demo", "text": "Hello world"})
        assert t.status_code == 200, t.text
        assert t.json() == {"model": "demo", "tokens": engine.tokenize("Hello world")}
        c = httpx.post(gw.url + "/v1/sample/count/to", timeout=60,
                       json={"model": "demo", "text": "to be or not to be"})
        assert c.status_code == 200, c.text
        assert c.json() == {"word": "to", "count": 2}  # the path parameter reached the runner
        c = httpx.post(gw.url + "/v1/sample/count/to?lower=true", timeout=60,
                       json={"model": "demo", "text": "To be or not to be"})
        assert c.status_code == 200, c.text
        assert c.json() == {"word": "to", "count": 2}  # and so did the query string
        t = httpx.post(url, timeout=60, json={"model": "nope", "text": "Hello world"})
        assert t.status_code == 404 and t.json()["error"]["code"] == "model_not_found"
    finally:
        rc, out = stop(gw)
    assert rc == 0, out
    (rec,) = [json.loads(x) for x in records.read_text().splitlines()]
    assert rec["request_id"] == r.json()["id"]
    assert (rec["api"], rec["stream"], rec["traceparent"]) == ("openai.chat", False,
                                                                TRACEPARENT)
    assert rec["tracestate"] == "vendor=1"  # (it was dropped)


@pytest.mark.model
def test_quantize_names_its_output_as_the_source_serves_the_model(tmp_path):
    """``quantize ollama:llama3.2 Q8_0`` wrote ``sha256-<hex>-q8_0.gguf``, the blob's stem:
    the default name is the one the source serves the model as (``sample:demo`` -> demo)."""
    env = {**os.environ, "PYTHONPATH": str(SITE), "JUSTLLM_PLUGINS": "justllm-sample"}
    done = subprocess.run([sys.executable, "-m", "justllm", "quantize", "sample:demo", "Q4_0",
                           "--allow-requantize", "-o", f"{tmp_path}/out/"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["demo-q4_0.gguf"]
