"""justllm-otel: spans from real requests on the demo model, in process (an in-memory exporter)
and from a real ``justllm serve`` exporting OTLP/HTTP to a receiver in this test."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Engine
from justllm.models.source import demo_model_path
from justllm.plugins import RequestRecord, load_plugins
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import justllm_otel

PHASES = ["queue", "prefill", "decode"]


# ---- fixtures and helpers ---------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path) -> Iterator[None]:
    """Only this plugin, no OTEL_* or JUSTLLM_* settings of the caller's (the model cache's
    location excepted), no user config; the entry point's plugin starts unconfigured."""
    for name in [n for n in os.environ if n.startswith(("OTEL_", "JUSTLLM_"))
                 and n != "JUSTLLM_CACHE_DIR"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("JUSTLLM_PLUGINS", "justllm-otel")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    justllm_otel.configure(None)
    yield
    justllm_otel.configure(None)


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(demo_model_path())


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    justllm_otel.configure(exp)
    return exp


def finished_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    assert justllm_otel.plugin.force_flush()
    return list(exporter.get_finished_spans())


def children(spans: list[ReadableSpan], root: ReadableSpan) -> list[ReadableSpan]:
    """The root's child spans in time order."""
    kids = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    return sorted(kids, key=lambda s: s.start_time or 0)


def a_record(**changes: Any) -> RequestRecord:
    fields: dict[str, Any] = dict(
        request_id="req-x", model="tiny", finish_reason="stop", prompt_tokens=5,
        completion_tokens=3, cached_tokens=2, arrived_at=1_700_000_000.25, queued_seconds=0.01,
        prefill_seconds=0.02, decode_seconds=0.03, total_seconds=0.06)
    return RequestRecord(**{**fields, **changes})


def check_phases(spans: list[ReadableSpan], root: ReadableSpan, names: list[str]) -> None:
    """The root's children are ``names``, INTERNAL, inside it and back to back in order."""
    kids = children(spans, root)
    assert [k.name for k in kids] == names
    at = root.start_time
    for kid in kids:
        assert kid.kind is SpanKind.INTERNAL
        assert kid.context.trace_id == root.context.trace_id
        assert at <= kid.start_time <= kid.end_time <= root.end_time
        at = kid.end_time


# ---- in process: an Engine and load_plugins ---------------------------------------------------

def test_engine_requests_become_spans(exporter, model_path):
    plugins = load_plugins()
    assert not plugins.problems
    events = plugins.request_events()
    assert events is not None
    model = Path(model_path).stem  # the id records carry by default
    prompts = {"plain": "The capital of France is", "sampled": "Once upon a time,",
               "aborted": "List three colors:"}
    engine = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=64))
    try:
        engine.observe(events)
        before = time.time()
        ids = {"plain": engine.add_request(prompts["plain"], SamplingParams(max_tokens=6)),
               "sampled": engine.add_request(prompts["sampled"], SamplingParams(
                   max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)),
               "aborted": engine.add_request(prompts["aborted"], SamplingParams(max_tokens=6))}
        assert engine.abort(ids["aborted"])  # while still queued: no phase ever ran
        tokens: dict[str, int] = {}
        final = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None
                tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.token_ids)
                if out.finished:
                    final[out.request_id] = out
        after = time.time()
        prompt_tokens = {k: len(engine.tokenize(p)) for k, p in prompts.items()}
    finally:
        engine.close()
    events.close()
    assert events.counts()["justllm-otel"].delivered == 3
    assert events.counts()["justllm-otel"].failed == 0

    spans = finished_spans(exporter)
    roots = {s.attributes["gen_ai.response.id"]: s for s in spans if s.parent is None}
    assert sorted(roots) == sorted(ids.values())
    assert len(spans) == 3 + 3 + 3  # two requests with three phases each, the aborted alone
    for key in ("plain", "sampled", "aborted"):
        root, rid = roots[ids[key]], ids[key]
        attrs = root.attributes
        assert root.name == f"generate_content {model}"
        assert root.kind is SpanKind.SERVER
        assert root.status.status_code is StatusCode.UNSET
        assert root.resource.attributes["service.name"] == "justllm"
        assert root.instrumentation_scope.name == "justllm_otel"
        assert attrs["gen_ai.operation.name"] == "generate_content"
        assert attrs["gen_ai.provider.name"] == "justllm"
        assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == model
        assert attrs["gen_ai.usage.input_tokens"] == prompt_tokens[key]
        assert attrs["gen_ai.usage.output_tokens"] == tokens.get(rid, 0)
        assert attrs["gen_ai.request.max_tokens"] == 6
        assert "error.type" not in attrs and "justllm.lora" not in attrs
        assert before - 0.05 <= root.start_time / 1e9 <= root.end_time / 1e9 <= after + 0.05
        if key == "aborted":
            assert attrs["gen_ai.response.finish_reasons"] == ("abort",)
            assert attrs["gen_ai.usage.output_tokens"] == 0
            assert "justllm.time_to_first_token" not in attrs
            check_phases(spans, root, [])
            continue
        out = final[rid]
        assert attrs["gen_ai.response.finish_reasons"] == (out.finish_reason,)
        assert attrs["gen_ai.usage.input_tokens"] == out.metrics.num_prompt_tokens
        assert attrs["gen_ai.usage.output_tokens"] == out.metrics.num_generated_tokens > 0
        assert attrs["gen_ai.usage.cache_read.input_tokens"] == out.metrics.num_cached_tokens
        check_phases(spans, root, PHASES)
        queue, prefill, _ = children(spans, root)
        assert attrs["justllm.time_to_first_token"] == pytest.approx(
            (prefill.end_time - queue.start_time) / 1e9, abs=1e-6)
    sampled, plain = roots[ids["sampled"]].attributes, roots[ids["plain"]].attributes
    assert sampled["gen_ai.response.finish_reasons"] == ("length",)  # ignore_eos
    assert sampled["gen_ai.usage.output_tokens"] == 6
    assert sampled["gen_ai.request.temperature"] == pytest.approx(0.8)
    assert sampled["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert sampled["gen_ai.request.seed"] == 7
    assert plain["gen_ai.request.temperature"] == 0.0  # always recorded; defaults otherwise not
    assert "gen_ai.request.top_p" not in plain and "gen_ai.request.seed" not in plain
    assert not any(k.startswith("gen_ai.input") or k.startswith("gen_ai.output.")
                   for k in sampled)  # no text without the opt-in (and none recorded)
    # its own provider, never the global one
    assert trace.get_tracer_provider() is not justllm_otel.plugin.tracer_provider


# ---- in process: hand-made records --------------------------------------------------------------

def test_error_record_gets_error_status_and_exact_times(exporter):
    record = a_record(finish_reason="error", error="llama_decode failed: -3", completion_tokens=0,
                      decode_seconds=None, total_seconds=0.04, lora="a+b",
                      params={"max_tokens": None, "temperature": 0.5, "top_k": 40, "min_p": 0.05,
                              "presence_penalty": 0.5, "frequency_penalty": 0.25})
    justllm_otel.plugin.on_request_finished(record=record)
    spans = finished_spans(exporter)
    (root,) = [s for s in spans if s.parent is None]
    assert root.name == "generate_content tiny"
    assert root.status.status_code is StatusCode.ERROR
    assert root.status.description == "llama_decode failed: -3"
    attrs = root.attributes
    assert attrs["error.type"] == "engine_error"
    assert attrs["justllm.error"] == "llama_decode failed: -3"
    assert attrs["gen_ai.response.finish_reasons"] == ("error",)
    assert attrs["justllm.lora"] == "a+b"
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 2
    assert "gen_ai.request.max_tokens" not in attrs  # None: no limit was asked for
    assert attrs["gen_ai.request.top_k"] == 40.0 and isinstance(attrs["gen_ai.request.top_k"],
                                                                float)
    assert attrs["gen_ai.request.presence_penalty"] == 0.5
    assert attrs["gen_ai.request.frequency_penalty"] == 0.25
    assert attrs["justllm.request.min_p"] == 0.05  # no GenAI name for it
    assert attrs["justllm.time_to_first_token"] == pytest.approx(0.03)
    # the failed request never decoded: queue and prefill only, at the record's own times
    start = round(1_700_000_000.25 * 1e9)
    assert (root.start_time, root.end_time) == (start, start + 40_000_000)
    check_phases(spans, root, ["queue", "prefill"])
    queue, prefill = children(spans, root)
    assert (queue.start_time, queue.end_time) == (start, start + 10_000_000)
    assert (prefill.start_time, prefill.end_time) == (start + 10_000_000, start + 30_000_000)


TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"


def test_a_request_with_a_traceparent_continues_the_clients_trace(exporter):
    justllm_otel.plugin.on_request_finished(record=a_record(
        api="openai.chat", stream=True, traceparent=TRACEPARENT, tracestate="vendor=1,b=2"))
    justllm_otel.plugin.on_request_finished(record=a_record(
        request_id="req-y", api="openai.completions", stream=False, traceparent="00-nonsense"))
    spans = finished_spans(exporter)
    chat = next(s for s in spans if s.attributes.get("gen_ai.response.id") == "req-x")
    assert chat.name == "chat tiny" and chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["justllm.api"] == "openai.chat"
    assert chat.attributes["justllm.stream"] is True
    assert "http.request.header.x-request-id" not in chat.attributes  # none recorded
    assert format(chat.context.trace_id, "032x") == TRACE_ID  # the client's trace
    assert chat.parent is not None and format(chat.parent.span_id, "016x") == SPAN_ID
    assert chat.parent.is_remote
    # the client's tracestate goes on with its trace (it was dropped)
    assert dict(chat.context.trace_state) == {"vendor": "1", "b": "2"}
    check_phases(spans, chat, list(PHASES))
    # A traceparent that does not parse: a trace of its own.
    plain = next(s for s in spans if s.attributes.get("gen_ai.response.id") == "req-y")
    assert plain.name == "text_completion tiny" and plain.parent is None
    assert plain.attributes["justllm.stream"] is False
    # llama-server's /completion and /infill are text completions (were generate_content)
    for api in ("llama.completion", "llama.infill"):
        justllm_otel.plugin.on_request_finished(record=a_record(request_id=api, api=api))
    spans = finished_spans(exporter)
    assert {s.name for s in spans if s.attributes.get("justllm.api", "").startswith("llama.")
            } == {"text_completion tiny"}


def test_message_content_only_with_the_opt_in(monkeypatch):
    record = a_record(prompt="<start_of_turn>user\nHi<end_of_turn>", output="Hello there")
    for value, expect in (("", False), ("false", False), ("true", True), ("TRUE", True)):
        monkeypatch.setenv(justllm_otel.CAPTURE_ENV, value)
        exporter = InMemorySpanExporter()
        justllm_otel.configure(exporter)  # the environment is read again on the next record
        justllm_otel.plugin.on_request_finished(record=record)
        (root,) = [s for s in finished_spans(exporter) if s.parent is None]
        assert ("gen_ai.input.messages" in root.attributes) is expect, value
        assert ("gen_ai.output.messages" in root.attributes) is expect, value
    assert json.loads(root.attributes["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": record.prompt}]}]
    assert json.loads(root.attributes["gen_ai.output.messages"]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "Hello there"}],
         "finish_reason": "stop"}]


@pytest.mark.parametrize("env", [
    {},
    {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
    {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9"},
], ids=["no-settings", "exporter-none", "sdk-disabled"])
def test_inert_without_settings(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plugins = load_plugins()
    assert not plugins.problems
    events = plugins.request_events()
    assert events is not None
    events(a_record())
    events.close()
    counts = events.counts()["justllm-otel"]
    assert (counts.delivered, counts.failed) == (1, 0)
    assert justllm_otel.plugin.tracer_provider is None  # nothing set up, so nothing exported
    assert justllm_otel.plugin.force_flush()


def test_console_exporter_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-llm")
    justllm_otel.plugin.on_request_finished(record=a_record())
    assert justllm_otel.plugin.force_flush()
    captured = capsys.readouterr()
    assert captured.out == ""  # stderr: stdout is the model's output under `justllm run`
    assert '"name": "generate_content tiny"' in captured.err
    assert '"service.name": "my-llm"' in captured.err


# ---- a real `justllm serve` exporting to a real OTLP/HTTP endpoint ------------------------------

class Receiver:
    """An OTLP/HTTP trace endpoint on a free loopback port: keeps every export request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, ExportTraceServiceRequest]] = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                received.append((self.path, message))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[tuple[dict[str, Any], str, Any]]:
        """(resource attributes, scope name, span) for every span received."""
        return [(attributes(rs.resource.attributes), ss.scope.name, span)
                for _, message in self.requests for rs in message.resource_spans
                for ss in rs.scope_spans for span in ss.spans]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def attributes(pairs: list[KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, kind)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_seed_past_int64_is_exported_as_the_client_sent_it(caplog):
    """SamplingParams keeps a seed modulo 2**64: the common ``-1`` is 2**64 - 1, which OTLP's
    int64 cannot carry (the exporter logged a traceback per span and dropped the attribute)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    receiver = Receiver()
    try:
        justllm_otel.configure(OTLPSpanExporter(endpoint=receiver.url))
        for seed in (-1, 2**63, 7):
            justllm_otel.plugin.on_request_finished(record=a_record(
                request_id=f"seed{seed}", params={"seed": SamplingParams(seed=seed).seed}))
        assert justllm_otel.plugin.force_flush()
    finally:
        receiver.close()
    seeds = {attrs["gen_ai.response.id"]: attrs["gen_ai.request.seed"]
             for attrs in (attributes(s.attributes) for _, _, s in receiver.spans())
             if "gen_ai.response.id" in attrs}
    assert seeds == {"seed-1": -1, f"seed{2**63}": -2**63, "seed7": 7}
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_serve_exports_otlp_http_and_flushes_at_exit(model_path):
    receiver = Receiver()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ,
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
           "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=test",
           justllm_otel.CAPTURE_ENV: "true",
           # Far longer than the test: the spans can only arrive through the flush at exit
           # (shutdown_on_exit), which is what this test is about, and nothing waits on it.
           "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "justllm", "serve", model_path, "--port", str(port),
         "--served-model-name", "demo", "--max-seqs", "2", "--pool-blocks", "64",
         "--record-text"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the server did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        answer = httpx.post(url + "/v1/completions", timeout=60, headers={
            "traceparent": TRACEPARENT, "X-Request-Id": "trace-7"}, json={
            "model": "demo", "prompt": "The capital of France is", "max_tokens": 5,
            "temperature": 0.7, "top_p": 0.95, "seed": 11}).json()
        assert not receiver.requests  # batched, not sent yet
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        receiver.close()

    assert {path for path, _ in receiver.requests} == {"/v1/traces"}
    received = receiver.spans()
    # The request span continues the client's trace, as a child of its span.
    roots = [(res, scope, s) for res, scope, s in received
             if s.parent_span_id.hex() == SPAN_ID]
    assert len(roots) == 1 and len(received) == 4
    resource, scope, root = roots[0]
    assert root.trace_id.hex() == TRACE_ID
    assert resource["service.name"] == "justllm"
    assert resource["deployment.environment.name"] == "test"
    assert scope == "justllm_otel"
    assert root.name == "text_completion demo"
    attrs = attributes(root.attributes)
    assert attrs["justllm.api"] == "openai.completions" and attrs["justllm.stream"] is False
    assert attrs["http.request.header.x-request-id"] == ("trace-7",)
    usage = answer["usage"]
    assert attrs["gen_ai.provider.name"] == "justllm"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "demo"
    assert attrs["gen_ai.response.id"]  # the engine's request id (not the API's cmpl-... id)
    assert attrs["gen_ai.response.finish_reasons"] == (answer["choices"][0]["finish_reason"],)
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.95)
    assert attrs["gen_ai.request.seed"] == 11
    output = json.loads(attrs["gen_ai.output.messages"])
    assert output[0]["parts"][0]["content"] == answer["choices"][0]["text"]
    assert "The capital of France is" in json.loads(
        attrs["gen_ai.input.messages"])[0]["parts"][0]["content"]
    kids = sorted((s for _, _, s in received if s.parent_span_id == root.span_id),
                  key=lambda s: s.start_time_unix_nano)
    assert [k.name for k in kids] == PHASES
    assert all(k.trace_id == root.trace_id for k in kids)
    at = root.start_time_unix_nano
    for kid in kids:
        assert at <= kid.start_time_unix_nano <= kid.end_time_unix_nano <= root.end_time_unix_nano
        at = kid.end_time_unix_nano


def test_ctrl_c_while_a_silent_collector_is_waited_for_at_exit_is_no_traceback(model_path):
    """`justllm run` has answered; at exit the batch goes to a collector that accepts the
    connection and never replies. Ctrl-C ends that wait: no traceback (the SDK's own exit hook
    printed one, "Exception ignored in atexit callback")."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    env = {**os.environ,
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT":
               f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "600",  # the exit would wait this long
           "OTEL_BSP_SCHEDULE_DELAY": "600000"}  # the batch goes out at exit only
    proc = subprocess.Popen(
        [sys.executable, "-m", "justllm", "run", model_path, "-p", "Hi", "--raw", "-n", "2",
         "--pool-blocks", "64"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not accepted:  # the answer is out, the exit's export is in flight
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no export at exit"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()
        for conn in accepted:
            conn.close()
    assert proc.returncode == 0, err
    assert out.strip() and "Traceback" not in err and "KeyboardInterrupt" not in err, err
