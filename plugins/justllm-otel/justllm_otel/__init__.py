"""justllm-otel: OpenTelemetry traces of the requests justllm serves.

The entry point (``justllm_otel:plugin``) is an ``OtelPlugin`` whose ``on_request_finished``
turns each ``RequestRecord`` into spans (``spans.py``). Nothing happens at import time, so every
``justllm`` command that loads plugins stays as fast as without this one: the environment is
read, and the OpenTelemetry SDK imported, on the first finished request.

The plugin exports only when asked to: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``,
``none``; a comma list) or an OTLP endpoint (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_EXPORTER_OTLP_ENDPOINT``) is set. Without either it does nothing: someone who installed
it but runs no collector gets no connection errors every few seconds. Everything else is the
SDK's and the exporter's own standard variables (service name, resource attributes, headers,
batching, sampling).

It keeps its own ``TracerProvider`` and never sets the global one, which belongs to the
application (a user's own instrumentation may set it). Tests inject an exporter with
``configure(exporter)``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from justllm.plugins import RequestRecord, hookimpl

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

__all__ = ["CAPTURE_ENV", "OtelPlugin", "configure", "plugin"]
__version__ = "0.1.0"

log = logging.getLogger("justllm.plugins.otel")

# The GenAI instrumentations' standard opt-in for message content. "true" is the documented
# value; the newer span_only / span_and_event (opentelemetry-util-genai) also turn it on here,
# where the content goes on the span.
CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
CAPTURE_VALUES = frozenset({"true", "span_only", "span_and_event"})
DEFAULT_SERVICE_NAME = "justllm"
SCOPE = "justllm_otel"


@dataclass(frozen=True)
class _Setup:
    """What the first record decided: ``tracer`` None means do nothing."""

    provider: TracerProvider | None = None
    tracer: Tracer | None = None
    content: bool = False
    at_exit: Callable[[], None] | None = None  # the provider's flush at exit (atexit)


class OtelPlugin:
    """The plugin object. ``exporter``: send spans there (through a BatchSpanProcessor)
    instead of what the environment says; for tests (``InMemorySpanExporter``) and for
    embedding justllm with an exporter of one's own."""

    def __init__(self, exporter: SpanExporter | None = None) -> None:
        self._exporter = exporter
        self._setup: _Setup | None = None
        self._lock = threading.Lock()

    @hookimpl
    def on_request_finished(self, record: RequestRecord) -> None:
        setup = self._get()
        if setup.tracer is not None:
            from justllm_otel.spans import record_spans

            record_spans(setup.tracer, record, content=setup.content)

    @property
    def tracer_provider(self) -> TracerProvider | None:
        """The provider once a record made one (None before, and when inert)."""
        setup = self._setup
        return setup.provider if setup is not None else None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export the spans still batched; True when there were none or all went out."""
        provider = self.tracer_provider
        return provider.force_flush(timeout_millis) if provider is not None else True

    def reset(self, exporter: SpanExporter | None = None) -> None:
        """Flush and shut down the current provider; the next record sets up afresh (reading
        the environment again), with ``exporter`` if given."""
        with self._lock:
            setup, self._setup, self._exporter = self._setup, None, exporter
        if setup is not None and setup.provider is not None:
            if setup.at_exit is not None:
                atexit.unregister(setup.at_exit)
            setup.provider.shutdown()

    def _get(self) -> _Setup:
        setup = self._setup
        if setup is None:
            with self._lock:
                if self._setup is None:
                    self._setup = self._build()
                setup = self._setup
        return setup

    def _build(self) -> _Setup:
        env = os.environ
        content = env.get(CAPTURE_ENV, "").strip().lower() in CAPTURE_VALUES
        if self._exporter is None and not wants_export(env):
            return _Setup(content=content)
        try:
            return _provider_setup(self._exporter, content)
        except Exception as e:  # a bad setting: say so once, then stay out of the way
            log.warning("justllm-otel: tracing is off: %s: %s", type(e).__name__, e)
            return _Setup(content=content)


def wants_export(env: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces: an exporter other than ``none``, or an OTLP
    endpoint; and the SDK not disabled (``OTEL_SDK_DISABLED``)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    names = _exporter_names(env)
    if names:
        return "none" not in names
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    return [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")
            if n.strip()]


def _provider_setup(exporter: SpanExporter | None, content: bool) -> _Setup:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [exporter] if exporter is not None else _env_exporters(os.environ)
    if not exporters:
        return _Setup(content=content)
    # An atexit hook flushes the batch when the process ends, after `justllm serve` or
    # `justllm run` has delivered the last records (events.close()); our own, not the SDK's
    # (shutdown_on_exit), which a Ctrl-C during the flush turned into a traceback.
    provider = TracerProvider(resource=_resource(), shutdown_on_exit=False)
    for each in exporters:
        provider.add_span_processor(BatchSpanProcessor(each))
    at_exit = functools.partial(_shutdown_at_exit, provider)
    atexit.register(at_exit)
    return _Setup(provider, provider.get_tracer(SCOPE, __version__), content, at_exit)


def _shutdown_at_exit(provider: TracerProvider) -> None:
    """Export what is batched as the process ends. A collector that does not answer is waited
    for up to the exporter's timeout (OTEL_EXPORTER_OTLP_TIMEOUT, 10 s); Ctrl-C ends the wait,
    and the batch is lost, as with SIGKILL."""
    try:
        provider.shutdown()
    except KeyboardInterrupt:
        pass


def _env_exporters(env: Mapping[str, str]) -> list[SpanExporter]:
    """The exporters OTEL_TRACES_EXPORTER names (default ``otlp``), each configured by its own
    standard variables."""
    out: list[SpanExporter] = []
    for name in _exporter_names(env) or ["otlp"]:
        if name == "otlp":
            protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
            if protocol != "http/protobuf":
                log.warning("justllm-otel: OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported; "
                            "sending http/protobuf", protocol)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            out.append(OTLPSpanExporter())  # endpoint, headers, timeout, TLS: from the env
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            # stderr: stdout is the model's output under `justllm run`
            out.append(ConsoleSpanExporter(out=sys.stderr))
        else:
            log.warning("justllm-otel: OTEL_TRACES_EXPORTER=%s is not supported (otlp, "
                        "console, none); ignored", name)
    return out


def _resource():
    """The SDK's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, the SDK's own
    attributes) with service.name ``justllm`` unless one of those named it."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


plugin = OtelPlugin()


def configure(exporter: SpanExporter | None) -> OtelPlugin:
    """Make the entry point's plugin send its spans to ``exporter`` from the next record on,
    whatever the environment says (None: back to the environment). Returns the plugin, whose
    ``force_flush()`` exports what is batched. For tests::

        exporter = InMemorySpanExporter()
        justllm_otel.configure(exporter)
        ...  # requests finish
        justllm_otel.plugin.force_flush()
        exporter.get_finished_spans()
    """
    plugin.reset(exporter)
    return plugin
