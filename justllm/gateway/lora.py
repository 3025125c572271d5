"""LoRA adapters loaded at run time through the router-mode gateway: vLLM's
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, forwarded to every replica of
the adapter's base model. The gateway keeps what was loaded (``ModelState.runtime_lora``), so
a replica that starts later -- restarted, added by the autoscaler, or the model loaded again
after its ttl -- gets the adapter before it takes requests (``Supervisor._spawn_ready``), and
the adapter's name is a model name of the gateway (routed to its base model) until unloaded.

Only for models whose runners take runtime loads (``enable-lora-runtime: true`` in
``models.yaml``); the bodies are vLLM's, plus ``model`` (the base model) when the gateway
serves more than one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httpx
import msgspec
from litestar import Request, Response, get, post
from litestar.datastructures import State

from justllm.server.errors import APIError
from justllm.server.lora import (
    LoadLoraRequest,
    UnloadLoraRequest,
    already_loaded,
    checked_name,
    name_taken,
    not_loaded_at_run_time,
    runtime_off,
    success,
)

if TYPE_CHECKING:
    from justllm.gateway.replica import Replica
    from justllm.gateway.supervisor import ModelState, Supervisor

log = logging.getLogger(__name__)
_JSON = {"content-type": "application/json"}


class GatewayLoadLora(LoadLoraRequest, kw_only=True, forbid_unknown_fields=True):
    """A runner's load body (``lora_path``: a path on the replicas' machines) and the base
    model, needed when the gateway serves several."""

    model: str | None = None


async def send(http: httpx.AsyncClient, url: str, route: str,
               body: bytes) -> httpx.Response | str:
    """One runtime-LoRA call to one replica: its answer, or why there was none."""
    try:
        return await http.post(f"{url}/v1/{route}", content=body, headers=_JSON, timeout=120)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


def _ok(answer: httpx.Response | str) -> bool:
    return not isinstance(answer, str) and answer.status_code == 200


def _unload_body(name: str) -> bytes:
    return msgspec.json.encode({"lora_name": name})


async def apply_runtime_lora(http: httpx.AsyncClient, state: ModelState, url: str,
                             replica: str) -> None:
    """Load the model's runtime adapters into a replica that just started, before it is in
    the rotation (logged, not raised, when one does not load: the file may have gone since).
    Loads and unloads through the gateway meanwhile skip it (it is not ready yet), so it
    catches up with them here until it holds exactly the gateway's set."""
    applied: set[str] = set()
    while True:
        missing = [n for n in state.runtime_lora if n not in applied]
        gone = [n for n in applied if n not in state.runtime_lora]
        if not missing and not gone:
            return
        for name in missing:
            body = state.runtime_lora.get(name)
            if body is None:  # unloaded while the ones before were loading
                continue
            applied.add(name)
            answer = await send(http, url, "load_lora_adapter", body)
            if not _ok(answer):
                why = answer if isinstance(answer, str) else answer.text
                log.warning("model %s replica %s: the LoRA adapter %s loaded at run time did "
                            "not load: %s", state.spec.name, replica, name, why)
                absent(state, name, replica)
            else:
                present(state, name, {replica})
        for name in gone:
            applied.discard(name)
            await send(http, url, "unload_lora_adapter", _unload_body(name))


def _ready(state: ModelState) -> list[Replica]:
    """The replicas a load or unload goes to now (an unhealthy one catches up when it comes
    back: :func:`_missed`)."""
    return [r for r in state.replicas if r.status == "ready" and r.url]


def _missed(state: ModelState, name: str) -> None:
    """The unhealthy replicas miss this change of ``name``: noted for their return."""
    for r in state.replicas:
        if r.status == "unhealthy":
            state.lora_missed.setdefault(r.id, set()).add(name)


async def catch_up_lora(http: httpx.AsyncClient, state: ModelState, replica: Replica) -> None:
    """A replica that was unhealthy while adapters were loaded or unloaded at run time, back
    before it takes requests again: each of those adapters as the gateway holds it now,
    loaded (in place) or unloaded (under ``Supervisor.lora_lock``). A load it refuses is
    logged, as for a replica that starts (the file may have gone since)."""
    url = replica.url or ""
    for name in sorted(state.lora_missed.pop(replica.id, ())):
        body = state.runtime_lora.get(name)
        if body is None:
            await send(http, url, "unload_lora_adapter", _unload_body(name))
            continue
        body = msgspec.json.encode({**msgspec.json.decode(body), "load_inplace": True})
        answer = await send(http, url, "load_lora_adapter", body)
        if not _ok(answer):
            why = answer if isinstance(answer, str) else answer.text
            log.warning("model %s replica %s: the LoRA adapter %s loaded at run time did not "
                        "load when the replica came back: %s", state.spec.name, replica.id,
                        name, why)
            absent(state, name, replica.id)
        else:
            present(state, name, {replica.id})


def present(state: ModelState, name: str, replicas: set[str]) -> None:
    """``replicas`` hold the runtime adapter ``name`` now (whatever :func:`absent` said)."""
    missing = state.lora_absent.get(name)
    if missing is not None:
        missing -= replicas


def absent(state: ModelState, name: str, replica: str) -> None:
    """Replica ``replica`` could not load the runtime adapter ``name``: requests for it skip
    that replica (it answered them 404, while the gateway listed the adapter). With no
    replica left that holds it, the gateway forgets it: no longer listed, a 404 naming the
    models; loading it again (from a file that is there) brings it back."""
    missing = state.lora_absent.setdefault(name, set())
    missing.add(replica)
    if all(r.id in missing or r.status in ("failed", "stopping") for r in state.replicas):
        state.runtime_lora.pop(name, None)
        state.lora_absent.pop(name, None)
        log.warning("model %s: no replica holds the LoRA adapter %s now: the gateway forgot "
                    "it (load it again)", state.spec.name, name)


def _refusal(answer: httpx.Response | str, replica: Replica) -> Response:
    """A replica's refusal, passed on as it came (the runner's OpenAI-shaped error)."""
    if isinstance(answer, str):
        raise APIError(502, f"replica {replica.id} did not answer: {answer}",
                       type="server_error", code="replica_failed")
    return Response(answer.content, status_code=answer.status_code,
                    media_type=answer.headers.get("content-type", "application/json"))


@post("/load_lora_adapter", status_code=200,
      summary="Load a LoRA adapter on every replica of its base model (vLLM's route)")
async def load_lora_adapter(request: Request, state: State) -> Response:
    from justllm.gateway.app import _model, _supervisor, _unavailable
    from justllm.gateway.supervisor import ModelUnavailable
    from justllm.server.app import decode_request

    sup = _supervisor(state)
    req = await decode_request(request, GatewayLoadLora)
    name = checked_name(req.lora_name)
    target = _model(sup, req.model)
    if not target.spec.lora_runtime:
        raise runtime_off(target.spec.name, "models.yaml")
    static = next((s for s in sup.models.values() if name in s.spec.adapters), None)
    if static is not None:  # a replica loads these at start, so they stay as they are
        raise APIError(400, f"the LoRA adapter '{name}' comes from models.yaml (model "
                            f"'{static.spec.name}'): change it there; loads here, in place "
                            "or not, are for other names", param="lora_name")
    _check_free(sup, target, name, req.load_inplace)
    try:
        await sup.acquire(target)  # loaded now if it was not
    except ModelUnavailable as e:
        raise _unavailable(e) from None
    try:
        async with sup.lora_lock:
            _check_free(sup, target, name, req.load_inplace)  # (again: one may have come)
            replicas = await _load(sup, target, name, req)
    finally:
        sup.end(target)
    if isinstance(replicas, Response):
        return replicas
    log.info("model %s: LoRA adapter %s loaded at run time on %d replica(s)",
             target.spec.name, name, len(replicas))
    return success(name, "added")


def _check_free(sup: Supervisor, target: ModelState, name: str, inplace: bool) -> None:
    """``name`` may be loaded on ``target``: no other model's or alias, and only in place of
    its own earlier load."""
    owner = sup.resolve(name)
    if owner is not None and (owner is not target or name not in target.runtime_lora):
        raise name_taken(name, "gateway")
    if name in target.runtime_lora and not inplace:
        raise already_loaded(name)


async def _load(sup: Supervisor, target: ModelState, name: str,
                req: GatewayLoadLora) -> list[Replica] | Response:
    """The load on every ready replica (under ``sup.lora_lock``): the replicas that took it,
    or the first refusal, after the others are put back as they were."""
    body = msgspec.json.encode({"lora_name": name, "lora_path": req.lora_path,
                                "load_inplace": req.load_inplace})
    before = target.runtime_lora.get(name)
    target.runtime_lora[name] = body  # replicas that start from now on load it too
    replicas = _ready(target)
    _missed(target, name)
    answers = await asyncio.gather(*(send(sup.http, r.url or "", "load_lora_adapter", body)
                                     for r in replicas))
    refused = next(((r, a) for r, a in zip(replicas, answers) if not _ok(a)), None)
    if refused is not None:  # none keeps it (or all keep the one it was to replace)
        if before is None:
            route, undo = "unload_lora_adapter", _unload_body(name)
        else:  # the one it was to replace, back in its place
            route = "load_lora_adapter"
            undo = msgspec.json.encode({**msgspec.json.decode(before), "load_inplace": True})
        await asyncio.gather(*(send(sup.http, r.url or "", route, undo)
                               for r, a in zip(replicas, answers) if _ok(a)))
        if before is None:
            target.runtime_lora.pop(name, None)
        else:
            target.runtime_lora[name] = before
        return _refusal(refused[1], refused[0])
    present(target, name, {r.id for r in replicas})  # (one that could not before has it now)
    return replicas


@post("/unload_lora_adapter", status_code=200,
      summary="Unload a LoRA adapter from every replica of its base model (vLLM's route)")
async def unload_lora_adapter(request: Request, state: State) -> Response:
    from justllm.gateway.app import _supervisor
    from justllm.server.app import decode_request

    sup = _supervisor(state)
    req = await decode_request(request, UnloadLoraRequest)
    name = req.lora_name
    async with sup.lora_lock:  # after a load of it in progress, which may yet fail
        owner = next((s for s in sup.models.values() if name in s.runtime_lora), None)
        if owner is None:
            raise not_loaded_at_run_time(
                name, any(name in s.spec.adapters for s in sup.models.values()), "models.yaml")
        owner.runtime_lora.pop(name, None)  # no new request is routed to it from now on
        owner.lora_absent.pop(name, None)
        _missed(owner, name)
        await asyncio.gather(*(send(sup.http, r.url or "", "unload_lora_adapter",
                                    _unload_body(name)) for r in _ready(owner)))
    log.info("model %s: LoRA adapter %s unloaded", owner.spec.name, name)
    return success(name, "removed")


class GatewayLoraInfo(msgspec.Struct):
    """One adapter of the gateway: a runner's ``GET /v1/lora_adapters`` entry and its base
    model. ``id`` is what the ``lora`` field takes for it: a models.yaml adapter's, the same on
    every replica; null for one loaded at run time, which each replica numbers in its own
    order (such an id is refused: choose it by name)."""

    id: int | None
    name: str
    path: str
    scale: float
    model: str


@get("/lora_adapters", summary="Every model's LoRA adapters, with the ids the `lora` field takes")
async def list_lora_adapters(state: State) -> list[GatewayLoraInfo]:
    from justllm.gateway.app import _supervisor

    out = []
    for s in _supervisor(state).models.values():
        out += [GatewayLoraInfo(i, a.name, a.path, a.scale, s.spec.name)
                for i, a in enumerate(s.spec.lora_specs)]
        out += [GatewayLoraInfo(None, name, msgspec.json.decode(body)["lora_path"], 1.0,
                                s.spec.name) for name, body in s.runtime_lora.items()]
    return out


ROUTES = [load_lora_adapter, unload_lora_adapter, list_lora_adapters]
