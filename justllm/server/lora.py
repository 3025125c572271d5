"""LoRA adapters over HTTP, as vLLM and llama-server expose them.

- A request names an adapter as its ``model`` (vLLM: each adapter is a model in ``/v1/models``
  whose ``parent`` is the base) and/or lists adapters in llama-server's ``lora`` field
  (``[{"id" | "name", "scale"}]``, ids as ``GET /v1/lora_adapters`` gives them). The field adds
  to, or rescales, the adapter named as ``model``; adapters it does not list are not applied
  (llama-server applies every adapter loaded at start unless told otherwise; here the base
  model is the default).
- llama-server's ``GET /lora-adapters`` and ``POST /lora-adapters`` (``[{"id" | "name",
  "scale"}]``): its global scales, the adapters a request that chooses none (no adapter as
  ``model``, no or an empty ``lora`` field) runs under; the adapters a POST does not list are
  not applied. None by default: a server started with ``--lora`` serves the base model to
  requests that do not ask for an adapter, as vLLM does (llama-server applies them unless
  ``--lora-init-without-apply``); one POST gives llama-server's default.
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST
  /v1/unload_lora_adapter`` ``{"lora_name"}`` (and vLLM's ``lora_int_id``, checked against
  the adapter's id) (vLLM's routes and bodies), with
  ``--enable-lora-runtime`` only (404 otherwise). Unloading waits for the adapter's running
  requests; new ones are refused from the moment it starts.
"""

from __future__ import annotations

import msgspec
from litestar import Request, Response, get, post
from litestar.datastructures import State

from justllm.config import check_lora_name
from justllm.core.sampling_params import MAX_LORA_SCALE
from justllm.engine.async_engine import AsyncEngine
from justllm.engine.lora import LoadedLora
from justllm.errors import InvalidRequestError, ModelLoadError
from justllm.server.errors import APIError
from justllm.server.schemas import LoraChoice, ModelCard


class LoadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of that name (after its requests)


class UnloadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's unload body as router mode and a cluster take it: the name alone (vLLM's
    ``lora_int_id`` is refused there, as an unknown field: their replicas number an adapter
    loaded at run time each in its own order, so no id names it)."""

    lora_name: str


class ServerUnloadLoraRequest(UnloadLoraRequest, kw_only=True, forbid_unknown_fields=True):
    """One server's unload body: with vLLM's ``lora_int_id``, which must be the named
    adapter's id (``GET /v1/lora_adapters``); it was taken and never read."""

    lora_int_id: int | None = None


class GlobalScale(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An entry of llama-server's ``POST /lora-adapters``: an adapter by id or name."""

    id: int | None = None
    name: str | None = None
    scale: float


class LoraAdapterInfo(msgspec.Struct):
    """One loaded adapter (llama-server's GET /lora-adapters shape, with the name)."""

    id: int
    name: str
    path: str
    scale: float


def adapter(aengine: AsyncEngine, name: str | None) -> LoadedLora | None:
    if not name:
        return None
    return next((a for a in aengine.lora_adapters() if a.name == name), None)


def no_adapter_embeddings(name: str, base: str) -> InvalidRequestError:
    """The 400 for embeddings asked of an adapter (``/v1/embeddings``, Ollama's): they come
    from the base model."""
    return InvalidRequestError(f"'{name}' is a LoRA adapter of {base}; embeddings come from the "
                               f"base model: send model '{base}'", param="model")


def request_lora(aengine: AsyncEngine, model: str | None,
                 choices: list[LoraChoice] | None) -> tuple[tuple[str, float], ...]:
    """The ``(name, scale)`` adapters a request runs under: the one its ``model`` names, then
    its ``lora`` entries (a 400 for one that names no loaded adapter)."""
    chosen: dict[str, float] = {}
    named = adapter(aengine, model)
    if named is None and not choices:  # none chosen: llama-server's global scales, if set
        return aengine.lora_defaults()
    if named is not None:
        chosen[named.name] = named.scale
    for i, c in enumerate(choices or []):
        found = _loaded(aengine, c.id, c.name, f"lora[{i}]")
        chosen[found.name] = found.scale if c.scale is None else c.scale
    return tuple(chosen.items())


def _loaded(aengine: AsyncEngine, id: int | None, name: str | None, where: str) -> LoadedLora:
    """The loaded adapter an entry names by ``id`` or ``name`` (a 400 at ``where`` else)."""
    if (id is None) == (name is None):
        raise InvalidRequestError(f"{where}: give an adapter's id or its name", param=where)
    loaded = aengine.lora_adapters()
    found = next((a for a in loaded if (a.id == id if name is None else a.name == name)), None)
    if found is None:
        what = f"id {id}" if name is None else f"name '{name}'"
        names = ", ".join(f"{a.id}: {a.name}" for a in loaded) or "none"
        raise InvalidRequestError(f"{where}: no LoRA adapter with {what} is loaded "
                                  f"(loaded: {names})", param=where)
    return found


def adapter_cards(aengine: AsyncEngine, base: str, created: int) -> list[ModelCard]:
    """``/v1/models`` entries for the adapters: each a model whose parent is the base."""
    return [ModelCard(a.name, "model", created, "justllm", parent=base,
                      max_model_len=aengine.max_request_tokens)
            for a in aengine.lora_adapters()]


def checked_name(name: str) -> str:
    """A runtime load's ``lora_name``, or the 400 saying what is wrong with it."""
    try:
        check_lora_name(name)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="lora_name") from None
    return name


def success(name: str, done: str) -> Response:
    """vLLM's answer to a load (``done`` "added") or an unload ("removed")."""
    return Response(f"Success: LoRA adapter '{name}' {done} successfully.",
                    media_type="text/plain")


def runtime_off(model: str, where: str) -> APIError:
    """A runtime load for a model whose replicas do not take them (``where``: the file that
    turns it on)."""
    return APIError(404, f"loading LoRA adapters at run time is off for model '{model}' (set "
                         f"enable-lora-runtime: true in its {where} entry)",
                    type="not_found_error")


def name_taken(name: str, of: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{name}' is already a model, alias or LoRA adapter name of "
                               f"this {of}", param="lora_name")


def already_loaded(name: str) -> InvalidRequestError:
    return InvalidRequestError(f"a LoRA adapter named '{name}' is already loaded "
                               "(load_inplace: true replaces it)", param="lora_name")


def not_loaded_at_run_time(name: str, static: bool, where: str) -> APIError:
    """An unload of a name that no runtime load gave: a 400 for an adapter of the config file
    (``where``), a 404 otherwise."""
    if static:
        return APIError(400, f"the LoRA adapter '{name}' comes from {where}: remove it there",
                        param="lora_name")
    return APIError(404, f"no LoRA adapter named '{name}' was loaded at run time",
                    type="not_found_error", param="lora_name")


def _runtime(state: State):
    from justllm.server.app import _served  # app imports this module: imported late

    served = _served(state)
    if not served.aengine.lora_runtime:
        raise APIError(404, "loading LoRA adapters at run time is off (start the server with "
                            "--enable-lora-runtime)", type="not_found_error")
    return served


@post("/load_lora_adapter", status_code=200, summary="Load a LoRA adapter (vLLM's route)")
async def load_lora_adapter(request: Request, state: State) -> Response:
    from justllm.server.app import decode_request

    served = _runtime(state)
    body = await decode_request(request, LoadLoraRequest)
    name = checked_name(body.lora_name)
    if name == served.model_id:
        raise InvalidRequestError(f"'{name}' is the base model's name", param="lora_name")
    aengine = served.aengine
    try:  # in place: the adapter it replaces stays unless the new file passes its checks
        await aengine.load_lora(name, body.lora_path, replace=body.load_inplace)
    except ModelLoadError as e:  # not an adapter, or not one for this model
        raise InvalidRequestError(str(e), param="lora_path") from None
    return success(name, "added")


@post("/unload_lora_adapter", status_code=200, summary="Unload a LoRA adapter (vLLM's route)")
async def unload_lora_adapter(request: Request, state: State) -> Response:
    from justllm.server.app import decode_request

    served = _runtime(state)
    body = await decode_request(request, ServerUnloadLoraRequest)
    loaded = adapter(served.aengine, body.lora_name)
    if loaded is None:
        raise APIError(404, f"no LoRA adapter named '{body.lora_name}' is loaded",
                       type="not_found_error", param="lora_name")
    if body.lora_int_id is not None and body.lora_int_id != loaded.id:
        raise InvalidRequestError(f"lora_int_id {body.lora_int_id} is not the id of the LoRA "
                                  f"adapter '{loaded.name}' (its id is {loaded.id}: see GET "
                                  "/v1/lora_adapters); leave it out to unload by name",
                                  param="lora_int_id")
    try:
        await served.aengine.unload_lora(body.lora_name)
    except InvalidRequestError:  # another unload of it came first
        raise APIError(404, f"no LoRA adapter named '{body.lora_name}' is loaded",
                       type="not_found_error", param="lora_name") from None
    return success(body.lora_name, "removed")


@get("/lora_adapters", summary="The loaded LoRA adapters, with the ids the `lora` field takes")
async def list_lora_adapters(state: State) -> list[LoraAdapterInfo]:
    from justllm.server.app import _served

    return [LoraAdapterInfo(a.id, a.name, a.path, a.scale)
            for a in _served(state).aengine.lora_adapters()]


@get("/lora-adapters", summary="llama-server's: the adapters and their global scales")
async def global_scales(state: State) -> list[LoraAdapterInfo]:
    """Each loaded adapter with the scale a request that chooses none runs it at (0: not
    applied), where ``GET /v1/lora_adapters`` gives the scale a request naming it gets."""
    from justllm.server.app import _served

    aengine = _served(state).aengine
    applied = dict(aengine.lora_defaults())
    return [LoraAdapterInfo(a.id, a.name, a.path, applied.get(a.name, 0.0))
            for a in aengine.lora_adapters()]


@post("/lora-adapters", status_code=200,
      summary="llama-server's: set the adapters a request that chooses none runs under")
async def set_global_scales(request: Request, state: State) -> dict[str, bool]:
    from justllm.server.app import _served

    aengine = _served(state).aengine
    # (read as JSON first: a body cut short or malformed was said to be "an object, not an
    # array" when it began with "{", where every other route says it is malformed)
    entries = msgspec.convert(msgspec.json.decode(await request.body()), list[GlobalScale],
                              strict=True)
    scales: dict[str, float] = {}
    for i, e in enumerate(entries):  # a later entry for the same adapter wins, as there
        if not abs(e.scale) <= MAX_LORA_SCALE:  # (NaN too) else every request would be refused
            raise InvalidRequestError(f"[{i}].scale must be a number in [-{MAX_LORA_SCALE:g}, "
                                      f"{MAX_LORA_SCALE:g}]", param=f"[{i}].scale")
        scales[_loaded(aengine, e.id, e.name, f"[{i}]").name] = e.scale
    aengine.set_lora_defaults(scales)
    return {"success": True}


ROUTES = [load_lora_adapter, unload_lora_adapter, list_lora_adapters]
LLAMA_SERVER_ROUTES = [global_scales, set_global_scales]
