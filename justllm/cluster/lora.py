"""LoRA adapters loaded at run time on a Ray cluster: vLLM's ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` on the ingress, served through Ray Serve's model multiplexing.

Router mode sends a load to every replica of the base model (justllm/gateway/lora.py). Ray has
no public way to reach every replica of a deployment, and its own answer to "many small models
on shared replicas" is multiplexing, so here a replica loads an adapter the first time a
request for it arrives (``@serve.multiplexed`` in justllm/cluster/deployments.py), keeps up to
``MAX_RUNTIME_ADAPTERS`` of them (least recently used first out), and tells Ray which it holds;
the router then prefers replicas that already hold a request's adapter (justllm/cluster/
router.py). The ingress keeps the registry -- name, base model, path -- and checks a new file by
loading it on one replica before anyone may use it, so a bad file is the client's 400 and never
a failed request later.

Each load gets a key of its own (``name@N``, Ray's multiplexed model id): a load in place of an
adapter is a new key, and a replica asked for it replaces the old file under the same name. The
ingress gives the stats board the current keys; a replica drops, within a report period or two,
what it holds that is no longer current (unloaded, or replaced). The registry lives in the
ingress, as a runtime load lives in a vLLM server: a redeploy forgets it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from itertools import count
from typing import Any

from litestar import Request, Response, post
from litestar.datastructures import State

from justllm.errors import InvalidRequestError
from justllm.gateway.lora import GatewayLoadLora
from justllm.server.errors import APIError
from justllm.server.lora import (
    UnloadLoraRequest,
    already_loaded,
    checked_name,
    name_taken,
    not_loaded_at_run_time,
    runtime_off,
    success,
)

log = logging.getLogger(__name__)

# Adapters one replica holds at once (Ray's max_num_models_per_replica); the least recently
# used leaves first. An adapter of the demo model's size is a few MB.
MAX_RUNTIME_ADAPTERS = 8


@dataclass(frozen=True)
class RuntimeAdapter:
    """One adapter loaded at run time: ``key`` is Ray's multiplexed model id for it."""

    name: str
    model: str  # the base model
    path: str  # on the replicas' machines
    key: str


@dataclass
class RuntimeAdapters:
    """The ingress's registry (pure bookkeeping; the routes below apply it). ``models``: the
    models whose replicas take runtime loads (``enable-lora-runtime: true``)."""

    models: frozenset[str] = frozenset()
    loaded: dict[str, RuntimeAdapter] = field(default_factory=dict)
    pending: dict[str, RuntimeAdapter] = field(default_factory=dict)  # being checked
    _versions: Iterator[int] = field(default_factory=lambda: count(1))

    def propose(self, name: str, model: str, path: str) -> RuntimeAdapter:
        """A new load (or a load in place of ``name``), pending until ``commit``: its key is
        current from now on, so no replica drops it while it is being checked."""
        adapter = RuntimeAdapter(name, model, path, f"{name}@{next(self._versions)}")
        self.pending[adapter.key] = adapter
        return adapter

    def commit(self, adapter: RuntimeAdapter) -> RuntimeAdapter | None:
        """The checked load takes its name; the adapter it replaces, if any."""
        self.pending.pop(adapter.key, None)
        before = self.loaded.get(adapter.name)
        self.loaded[adapter.name] = adapter
        return before

    def drop(self, adapter: RuntimeAdapter) -> None:
        """A pending load that failed its check."""
        self.pending.pop(adapter.key, None)

    def unload(self, name: str) -> RuntimeAdapter | None:
        return self.loaded.pop(name, None)

    def requested(self, model: Any, choices: Any) -> RuntimeAdapter | None:
        """The adapter loaded at run time that a request runs under: named as its ``model``,
        or by name in llama-server's ``lora`` field. Ray routes a request by one multiplexed
        model id, so naming two is the client's 400 (ids in ``lora`` are each replica's own
        and mean nothing here: adapters loaded at run time are named)."""
        found = [self.loaded[model]] if isinstance(model, str) and model in self.loaded else []
        for c in choices if isinstance(choices, list) else ():
            name = c.get("name") if isinstance(c, dict) else None
            if isinstance(name, str) and name in self.loaded and self.loaded[name] not in found:
                found.append(self.loaded[name])
        if len(found) > 1:
            raise InvalidRequestError(
                "a request on a Ray cluster runs under at most one LoRA adapter loaded at run "
                f"time (named: {', '.join(a.name for a in found)})", param="lora")
        return found[0] if found else None

    def entries(self) -> list[dict[str, str]]:
        """The loaded adapters as plain data, for the board to keep across ingress restarts."""
        return [asdict(a) for a in self.loaded.values()]

    def restore(self, entries: list[dict[str, str]] | None) -> None:
        """The loaded adapters an earlier ingress kept on the board (Ray restarted this one: a
        crash, a lost node), those of models that still take run-time loads; new keys go on
        from the highest version seen, so none is reused."""
        for e in entries or ():
            if e["model"] in self.models and e["name"] not in self.loaded:
                self.loaded[e["name"]] = RuntimeAdapter(**e)
        versions = [int(a.key.rpartition("@")[2]) for a in self.loaded.values()
                    if a.key.rpartition("@")[2].isdigit()]
        self._versions = count(max(versions, default=0) + 1)

    def current(self) -> dict[str, list[str]]:
        """model -> the keys its replicas may keep (loaded and pending), for the board."""
        found: dict[str, list[str]] = {m: [] for m in self.models}
        for a in [*self.loaded.values(), *self.pending.values()]:
            found.setdefault(a.model, []).append(a.key)
        return found


def stale_adapters(held: Mapping[str, str], current: list[str] | None) -> list[str]:
    """The adapter names a replica holds (``held``: name -> key) that it should drop: those
    whose key is no longer current. ``current`` None: the board does not know (it restarted,
    and nothing was loaded or unloaded since), so nothing is dropped."""
    if current is None:
        return []
    keep = set(current)
    return [name for name, key in held.items() if key not in keep]


def _ingress(state: State) -> Any:
    return state["ingress"]


async def _publish(ing: Any) -> None:
    await ing.board.set_runtime.remote(ing.runtime.current(), ing.runtime.entries())


async def restore_runtime(ing: Any) -> None:
    """At the ingress's start: the registry the board kept (a restarted ingress forgot every
    adapter loaded at run time, while the replicas kept them, unroutable), published back."""
    entries = await ing.board.runtime_entries.remote()
    ing.runtime.restore(entries)
    if entries:
        await _publish(ing)


@post("/load_lora_adapter", status_code=200,
      summary="Load a LoRA adapter for a model's replicas (vLLM's route; multiplexed)")
async def load_lora_adapter(request: Request, state: State) -> Response:
    from justllm.server.app import decode_request

    ing = _ingress(state)
    req = await decode_request(request, GatewayLoadLora)
    async with ing.lora_lock:
        return await _load(ing, req)


async def _load(ing: Any, req: GatewayLoadLora) -> Response:
    name = checked_name(req.lora_name)
    model = ing.model(req.model, False)
    if model not in ing.runtime.models:
        raise runtime_off(model, "cluster.yaml")
    before = ing.runtime.loaded.get(name)
    if (name in ing.names or name in ing.adapters
            or (before is not None and before.model != model)):
        raise name_taken(name, "cluster")
    if before is not None and not req.load_inplace:
        raise already_loaded(name)
    adapter = ing.runtime.propose(name, model, req.lora_path)
    try:
        await _publish(ing)
        # One replica loads it now (and keeps it): a file llama.cpp refuses is the client's
        # 400 here, never a failed request later.
        refused = await ing.handles[model].options(multiplexed_model_id=adapter.key) \
            .load_adapter.remote(adapter.name, adapter.path)
    except Exception as e:
        ing.runtime.drop(adapter)
        await _publish(ing)
        raise APIError(503, f"model '{model}' could not load the adapter: "
                            f"{type(e).__name__}", type="server_error",
                       code="replica_failed", headers={"Retry-After": "2"}) from None
    if refused:
        ing.runtime.drop(adapter)
        await _publish(ing)
        raise InvalidRequestError(refused, param="lora_path")
    ing.runtime.commit(adapter)
    await _publish(ing)  # the replaced key, if any, is dropped by the replicas that hold it
    log.info("model %s: LoRA adapter %s loaded at run time (%s)", model, name, adapter.key)
    return success(name, "added")


@post("/unload_lora_adapter", status_code=200,
      summary="Unload a LoRA adapter loaded at run time (vLLM's route)")
async def unload_lora_adapter(request: Request, state: State) -> Response:
    from justllm.server.app import decode_request

    ing = _ingress(state)
    req = await decode_request(request, UnloadLoraRequest)
    name = req.lora_name
    async with ing.lora_lock:
        if ing.runtime.unload(name) is None:
            raise not_loaded_at_run_time(name, name in ing.adapters, "cluster.yaml")
        await _publish(ing)  # no request is routed to it from now on; replicas drop it
    log.info("LoRA adapter %s unloaded", name)
    return success(name, "removed")


ROUTES = [load_lora_adapter, unload_lora_adapter]
