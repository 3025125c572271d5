"""The gateway's HTTP face: the OpenAI routes forwarded by the body's ``model`` to that model's
runner (loaded first if need be), the model list with status, load/unload, health, and one
``/metrics`` page for all. No module-level state: everything lives in ``app.state``."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
from litestar import Litestar, Request, Response, Router, get, post
from litestar.datastructures import State

from justllm.gateway.config import GatewayConfig
from justllm.gateway.metrics import render_metrics
from justllm.gateway.policy import keep_alive_seconds
from justllm.gateway.supervisor import ModelState, ModelUnavailable, Supervisor
from justllm.models.source import cache_dir
from justllm.server.app import require_api_key, sse_response, unless_disconnected
from justllm.server.errors import APIError, error_body, handle_exception

# A runner that died before answering: the request is sent once more to its successor.
_NOT_ANSWERED = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    shutdown_timeout: float = 5.0  # a stopping runner's drain (unload, ttl, SIGTERM)


def _supervisor(state: State) -> Supervisor:
    return state["supervisor"]


def _model(sup: Supervisor, name: Any) -> ModelState:
    if name is not None and not isinstance(name, str):
        raise APIError(400, "model must be a string", param="model")
    found = sup.resolve(name)
    if found is None:
        known = ", ".join(sup.config.names)
        raise APIError(404 if name else 400,
                       f"the model '{name}' does not exist; this server has: {known}"
                       if name else f"model is required (one of: {known})",
                       type="not_found_error" if name else "invalid_request_error",
                       param="model", code="model_not_found" if name else None)
    return found


def _unavailable(e: ModelUnavailable) -> APIError:
    return APIError(503, str(e), type="server_error", code=e.code,
                    headers={"Retry-After": "2"})


async def _forward(request: Request, path: str) -> Any:
    sup = _supervisor(request.app.state)
    raw = await request.body()
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    state = _model(sup, body.get("model"))
    keep_alive = None
    if "keep_alive" in body:  # Ollama's: the gateway's to honour; runners do not know it
        try:
            keep_alive = keep_alive_seconds(body.pop("keep_alive"))
        except ValueError as e:
            raise APIError(400, str(e), param="keep_alive") from None
    body["model"] = state.spec.name  # an alias becomes the runner's name
    content = msgspec.json.encode(body)
    try:
        runner = await sup.acquire(state)
    except ModelUnavailable as e:
        raise _unavailable(e) from None
    ended = False
    try:
        http: httpx.AsyncClient = request.app.state["http"]
        for attempt in (1, 2):
            try:
                response = await http.send(http.build_request(
                    "POST", runner.url + path, content=content,
                    headers={"content-type": "application/json"}), stream=True)
                if response.headers.get("content-type", "").startswith("text/event-stream"):
                    ended = True  # the stream's relay ends the request
                    return sse_response(_relay(response, sup, state, keep_alive))
                try:
                    data = await unless_disconnected(request, response.aread())
                finally:
                    await response.aclose()
            except _NOT_ANSWERED:
                # The runner died before the client got anything: once more on its successor.
                if attempt == 2:
                    raise APIError(503, f"model '{state.spec.name}' stopped answering",
                                   type="server_error", code="runner_failed",
                                   headers={"Retry-After": "2"}) from None
                try:
                    runner = await sup.wait_restarted(state, runner)
                except ModelUnavailable as e:
                    raise _unavailable(e) from None
                continue
            if isinstance(data, Response):  # the client left; the runner aborted on our close
                return data
            return Response(data, status_code=response.status_code,
                            media_type=response.headers.get("content-type",
                                                            "application/json"),
                            headers={k: v for k, v in response.headers.items()
                                     if k.lower() == "retry-after"})
        raise AssertionError("unreachable")
    finally:
        if not ended:
            sup.end(state, keep_alive)


async def _relay(response: httpx.Response, sup: Supervisor, state: ModelState,
                 keep_alive: float | None) -> AsyncIterator[bytes]:
    """A runner's SSE stream, byte for byte; if the runner dies mid-stream, a final error event
    and ``[DONE]``. Closing it (the client left) closes the runner's stream, which aborts."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError:
        yield (b"data: " + msgspec.json.encode(error_body(
            f"model '{state.spec.name}' stopped while streaming", "server_error",
            code="runner_failed")) + b"\n\ndata: [DONE]\n\n")
    finally:
        sup.end(state, keep_alive)  # first: the await below may be cancelled (client gone)
        await response.aclose()


@post("/chat/completions", status_code=200, summary="Chat completion, routed by model")
async def chat_completions(request: Request) -> Any:
    return await _forward(request, "/v1/chat/completions")


@post("/completions", status_code=200, summary="Text completion, routed by model")
async def completions(request: Request) -> Any:
    return await _forward(request, "/v1/completions")


@post("/embeddings", status_code=200, summary="Embeddings, routed by model")
async def embeddings(request: Request) -> Any:
    return await _forward(request, "/v1/embeddings")


@get("/models", summary="Every model, with its status (loaded, loading, unloaded, failed)")
async def list_models(state: State) -> dict:
    sup = _supervisor(state)
    created = int(state["started"])
    return {"object": "list", "data": [
        {"id": s.spec.name, "object": "model", "created": created, "owned_by": "justllm",
         "status": s.status, "aliases": list(s.spec.aliases)} for s in sup.models.values()]}


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@get("/models", summary="Runners in detail (justllm ps)")
async def models_status(state: State) -> dict:
    sup = _supervisor(state)
    now = time.monotonic()
    rows = []
    for s in sup.models.values():
        r = s.runner
        idle = now - s.last_used if s.status == "loaded" and s.active == 0 else 0.0
        rows.append({
            "model": s.spec.name, "aliases": list(s.spec.aliases), "status": s.status,
            "source": s.spec.source, "pid": r.pid if r else None,
            "url": r.url if r else None, "rss_mib": _rss_mib(r.pid) if r else None,
            "active": s.active, "idle_seconds": round(idle, 1),
            "unload_in": (round(max(0.0, s.ttl - idle), 1)
                          if s.status == "loaded" and s.ttl >= 0 and s.active == 0 else None),
            "ttl": s.ttl, "error": s.error, "loads": s.loads, "restarts": s.restarts,
            "estimate_mib": round(s.memory / 2**20) if s.memory else None,
            "log": str(sup.log_dir / f"{s.spec.name}.log")})
    return {"object": "list", "data": rows, "waiting_for_load": sup.waiting,
            "max_loaded": sup.config.max_loaded,
            "max_memory_mib": round(sup.config.max_memory / 2**20) or None}


class _ModelRef(msgspec.Struct, forbid_unknown_fields=True):
    model: str


@post("/models/load", status_code=200, summary="Load a model now")
async def load_model(request: Request, state: State) -> dict:
    sup = _supervisor(state)
    ref = msgspec.json.decode(await request.body(), type=_ModelRef)
    target = _model(sup, ref.model)
    try:
        await sup.load(target)
    except ModelUnavailable as e:
        raise _unavailable(e) from None
    return {"model": target.spec.name, "status": target.status}


@post("/models/unload", status_code=200, summary="Unload a model now")
async def unload_model(request: Request, state: State) -> dict:
    sup = _supervisor(state)
    ref = msgspec.json.decode(await request.body(), type=_ModelRef)
    target = _model(sup, ref.model)
    await sup.unload(target)
    return {"model": target.spec.name, "status": target.status}


@get("/health", summary="200 while the gateway is up")
async def health() -> dict:
    return {"status": "ok"}


@get("/metrics", summary="Prometheus metrics of the gateway and every loaded runner",
     media_type="text/plain; version=0.0.4")
async def metrics(state: State) -> Response:
    body = await render_metrics(_supervisor(state), state["http"])
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def create_gateway(config: GatewayConfig, settings: GatewaySettings, log_dir: Path) -> Litestar:
    state = State({"config": settings, "gateway": config, "started": time.time()})

    async def start(app: Litestar) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request
        app.state["http"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10),
                                              trust_env=False, limits=httpx.Limits(
                                                  max_connections=None,
                                                  max_keepalive_connections=64))
        sup = Supervisor(config, log_dir, settings.shutdown_timeout)
        app.state["supervisor"] = sup
        sup.start()

    async def stop(app: Litestar) -> None:
        await app.state["supervisor"].close()
        await app.state["http"].aclose()

    v1 = Router(path="/v1", route_handlers=[chat_completions, completions, embeddings,
                                            list_models], guards=[require_api_key])
    admin = Router(path="/", route_handlers=[models_status, load_model, unload_model],
                   guards=[require_api_key])
    return Litestar(route_handlers=[v1, admin, health, metrics], state=state,
                    on_startup=[start], on_shutdown=[stop],
                    exception_handlers={Exception: handle_exception},
                    request_max_body_size=settings.max_body_bytes, debug=False)


def default_log_dir() -> Path:
    """Where each model's runner log goes (``justllm logs MODEL`` reads it)."""
    return cache_dir() / "logs"


def all_runners_stopped(app: Litestar) -> None:
    """After the event loop ended (or on an unexpected exit): nothing may outlive us."""
    sup = app.state.get("supervisor")
    if sup is not None:
        sup.kill_all()

