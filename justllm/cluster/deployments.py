"""The Ray Serve deployments of a justllm app: one per model (``ModelReplica``), the ingress
(``ClusterIngress``) and the stats board (``StatsBoard``). Their options come from
justllm/cluster/options.py at deploy time (justllm/cluster/deploy.py); what runs inside a
model replica is justllm/cluster/host.py's, so this module is only the wiring to Ray.

Why a stats board: Ray gives a replica's ``record_routing_stats`` to the routers only (each
handle's), and nothing public lists a deployment's replicas with their stats. Each model
replica posts its stats and its /metrics page to the board every ``STATS_PERIOD``; the
ingress's /metrics and `justllm cluster status` read it. A replica that stops posting (it was
killed) drops off after ``STALE`` seconds; one stopped by Ray says so first. The board also
holds which LoRA adapters loaded at run time are current (justllm/cluster/lora.py), and answers
each report with them, so a replica drops the ones unloaded or replaced.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import ray
from ray import serve
from ray.serve import Deployment
from ray.serve.handle import DeploymentHandle

from justllm.cluster.asgi import Head
from justllm.cluster.host import EngineHost, Identity
from justllm.cluster.ingress import Ingress, create_ingress, disconnect_when_cancelled
from justllm.cluster.lora import MAX_RUNTIME_ADAPTERS, RuntimeAdapters, stale_adapters
from justllm.cluster.options import STATS_PERIOD
from justllm.config import EngineConfig
from justllm.errors import InvalidRequestError, JustLLMError
from justllm.server.anthropic import error_body as anthropic_error_body
from justllm.server.errors import APIError, error_body, llama_server_error, llama_server_path

log = logging.getLogger(__name__)

STALE = 3 * STATS_PERIOD + 2.0  # seconds without a report before a replica leaves the board
ROUTING_KEYS = ("running", "waiting", "kv_usage", "ttft_p50", "hit_ratio", "cache_blocks")


def adapter_failure(path: str, headers: list[tuple[str, str]], message: str) -> bytes:
    """A 400's body about the request's adapter in the API's own shape, as the server's
    exception handler (server/errors.handle_exception) would give it: Anthropic's on
    /v1/messages (or for its SDK), Ollama's under /api/, llama-server's on its own routes,
    else OpenAI's (it was OpenAI's on every API)."""
    if path.startswith("/v1/messages") or any(k.lower() == "anthropic-version"
                                              for k, _ in headers):
        body: dict[str, Any] = anthropic_error_body(400, message)
    elif path.startswith("/api/"):
        body = {"error": message}
    elif llama_server_path(path):
        body = llama_server_error(APIError(400, message, param="model"))
    else:
        body = error_body(message, "invalid_request_error", param="model")
    return msgspec.json.encode(body)


class ModelReplica:
    """One replica of one model: loads it once (resolved on this node), runs justllm's engine
    on its own thread and the server's app in front of it. ``role``: a PD model's prefill or
    decode deployment (the server's ``--role``), else "both"."""

    async def __init__(self, model: str,  # type: ignore[misc]  # Ray awaits it
                       engine_config: Callable[[], EngineConfig],
                       board: DeploymentHandle, role: str = "both") -> None:
        identity = Identity(model, serve.get_replica_context().replica_id.unique_id,
                            ray.get_runtime_context().get_node_id(),
                            ray.util.get_node_ip_address(), role)
        self.host = await asyncio.to_thread(EngineHost.load, identity, engine_config)
        self._board = board
        self._loop = asyncio.get_running_loop()
        # LoRA adapters loaded at run time: the file of each key asked for, and the key each
        # name holds now (justllm/cluster/lora.py).
        self._files: dict[str, tuple[str, str]] = {}
        self._held: dict[str, str] = {}
        self._reporter = self._loop.create_task(self._report())

    async def http(self, method: str, path: str, query: str,
                   headers: list[tuple[str, str]], body: bytes,
                   route: Any = None, lora: tuple[str, str] | None = None
                   ) -> AsyncIterator[Head | bytes]:
        """One HTTP request to justllm's app (``route`` is the RequestRouter's). ``lora``:
        the (name, path) of the adapter loaded at run time that the request names, loaded
        first if this replica does not hold it (Ray's multiplexed model id is its key)."""
        if lora is not None:
            try:
                await self._runtime_adapter(*lora)
            except Exception as e:  # the file changed or went since the ingress checked it
                yield Head(400, [("content-type", "application/json")])
                yield adapter_failure(path, headers,
                                      f"the LoRA adapter '{lora[0]}' could not be loaded: {e}")
                return
        async for item in self.host.http(method, path, query, headers, body):
            yield item

    async def load_adapter(self, name: str, path: str) -> str:
        """The ingress's check of a LoRA adapter loaded at run time (the call's multiplexed
        model id is its key): "" once this replica holds it, else why llama.cpp or the file
        checks refused it."""
        try:
            await self._runtime_adapter(name, path)
        except JustLLMError as e:
            return str(e)
        return ""

    async def _runtime_adapter(self, name: str, path: str) -> None:
        key = serve.get_multiplexed_model_id()
        self._files[key] = (name, path)  # for Ray's loader, if it does not hold the key
        try:
            await self._adapter(key)
        finally:
            self._files.pop(key, None)

    @serve.multiplexed(max_num_models_per_replica=MAX_RUNTIME_ADAPTERS)
    async def _adapter(self, key: str) -> HeldAdapter:
        """Ray's loader for a multiplexed model id: the adapter's file loaded under its name
        (in place of an older load of that name)."""
        name, path = self._files[key]
        await self.host.aengine.load_lora(name, path, replace=True)
        self._held[name] = key
        return HeldAdapter(self, name, key)

    async def drop_adapter(self, name: str, key: str) -> None:
        """Unload ``name`` if it still holds ``key`` (Ray evicted it, or the ingress unloaded
        or replaced it)."""
        if self._held.get(name) != key:
            return
        del self._held[name]
        try:
            await self.host.aengine.unload_lora(name)
        except InvalidRequestError:  # already being unloaded
            pass

    async def prefill(self, path: str, body: bytes, route: Any = None) -> bytes:
        """A PD model's first half, on a prefill replica: the prompt computed, its first token
        drawn and its KV exported (``/pd/prefill``: the hand-over), returned whole. Ray keeps
        the result in its object store, and the ingress passes the reference on to the decode
        replica's call, so the bytes go from node to node (or through shared memory on one
        node), never through the ingress.
        b"" when the replica refused: the decode replica then serves the request whole."""
        head: Head | None = None
        chunks: list[bytes] = []
        async for item in self.host.http("POST", "/pd/prefill", f"path={path}",
                                         [("content-type", "application/json")], body):
            if isinstance(item, Head):
                head = item
            else:
                chunks.append(item)
        return b"".join(chunks) if head is not None and head.status == 200 else b""

    async def pd_decode(self, method: str, path: str, query: str,
                        headers: list[tuple[str, str]], body: bytes, kv: bytes,
                        route: Any = None) -> AsyncIterator[Head | bytes]:
        """A PD model's second half, on a decode replica: the request served from the
        hand-over (``/pd/decode``: the request's length, the request, the hand-over), or whole
        when the prefill replica gave none. The answer's head says which
        (``x-pd``: the decode replica's ``handed-over``, ``kv-refused`` or
        ``handover-refused``, or ``prefill-refused``)."""
        if kv:
            target, query, content = ("/pd/decode", f"path={path}",
                                      struct.pack("<I", len(body)) + body + kv)
        else:
            target, content = path, body
        async for item in self.host.http(method, target, query, headers, content):
            if isinstance(item, Head) and not kv:
                item = Head(item.status, [*item.headers, ("x-pd", "prefill-refused")])
            yield item

    async def check_health(self) -> None:
        await self.host.check_health()

    async def record_routing_stats(self) -> dict[str, Any]:
        stats, _ = self.host.observe()
        return {k: stats[k] for k in ROUTING_KEYS}

    async def _report(self) -> None:
        while True:
            try:
                stats, page = self.host.observe()
                # Only what was held before the board answered: an adapter loaded meanwhile
                # may be newer than the board's answer.
                held = dict(self._held)
                current = await self._board.report.remote(stats, page)
                for name in stale_adapters(held, current):
                    await self.drop_adapter(name, held[name])
            except Exception as e:  # the board restarts with Ray; the next report gets there
                log.warning("stats report failed: %s", e)
            await asyncio.sleep(STATS_PERIOD)

    async def __del__(self) -> None:
        """Ray stops this replica (scaled down, redeployed, the app deleted): no more reports,
        off the board, the engine thread stopped and the model freed."""
        if not hasattr(self, "host"):  # the model never loaded: nothing to stop
            return
        self._reporter.cancel()
        identity = self.host.identity
        try:
            await asyncio.wait_for(
                self._board.forget.remote(identity.model, identity.replica), 2.0)
        except Exception:  # the board may be stopping too
            pass
        await asyncio.to_thread(self.host.close)


class HeldAdapter:
    """What Ray's multiplexing keeps for a LoRA adapter a replica holds; Ray calls
    ``__del__`` when it evicts it (from a worker thread: the unload runs on the replica's
    loop)."""

    def __init__(self, replica: ModelReplica, name: str, key: str) -> None:
        self.replica, self.name, self.key = replica, name, key
        self._dropped = False

    def __del__(self) -> None:
        if self._dropped:
            return
        self._dropped = True
        try:
            asyncio.run_coroutine_threadsafe(
                self.replica.drop_adapter(self.name, self.key), self.replica._loop)
        except RuntimeError:  # the replica's loop is closed: the engine went with it
            pass


class StatsBoard:
    """The last report of every model replica (see the module's docstring), and what the
    deploy said about the app (``info``: its URL, the Ray address)."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        self._rows: dict[str, dict[str, dict[str, Any]]] = {}  # model -> replica -> row
        self._runtime: dict[str, list[str]] | None = None  # model -> current adapter keys
        self._entries: list[dict[str, str]] = []  # the loaded adapters (RuntimeAdapter fields)

    async def report(self, stats: dict[str, Any], page: str) -> list[str] | None:
        """Take a replica's report; answer the keys of the LoRA adapters loaded at run time
        that its model's replicas may keep (None: not known since the board started)."""
        rows = self._rows.setdefault(stats["model"], {})
        rows[stats["replica"]] = {"stats": stats, "page": page, "at": time.monotonic()}
        self._prune(rows)  # (a model's replicas that died: rows kept until someone looked)
        if self._runtime is None:
            return None
        return self._runtime.get(stats["model"], [])

    async def set_runtime(self, current: dict[str, list[str]],
                          entries: list[dict[str, str]] | None = None) -> None:
        """The ingress's registry of LoRA adapters loaded at run time: model -> keys, and the
        loaded adapters themselves, which an ingress Ray restarts takes back."""
        self._runtime = current
        self._entries = entries or []

    async def runtime_entries(self) -> list[dict[str, str]]:
        return self._entries

    async def forget(self, model: str, replica: str) -> None:
        self._rows.get(model, {}).pop(replica, None)

    async def snapshot(self) -> dict[str, dict[str, dict[str, Any]]]:
        """model -> replica -> {stats, page, age}: the replicas heard from in ``STALE`` s."""
        now = time.monotonic()
        for rows in self._rows.values():
            self._prune(rows, now)
        return {model: {r: {"stats": row["stats"], "page": row["page"],
                            "age": round(now - row["at"], 2)} for r, row in rows.items()}
                for model, rows in self._rows.items()}

    @staticmethod
    def _prune(rows: dict[str, dict[str, Any]], now: float | None = None) -> None:
        """Drop the replicas not heard from in ``STALE`` seconds."""
        now = time.monotonic() if now is None else now
        for replica in [r for r, row in rows.items() if now - row["at"] > STALE]:
            del rows[replica]

    async def about(self) -> dict[str, Any]:
        return self.info


class ClusterIngress:
    """The HTTP face (justllm/cluster/ingress.py): a handle per model, names and aliases; a
    PD model's prefill deployment beside its decode one."""

    def __init__(self, handles: dict[str, DeploymentHandle], names: dict[str, str],
                 board: DeploymentHandle, api_key: str | None,
                 prefill: dict[str, tuple[DeploymentHandle, int]] | None = None,
                 adapters: frozenset[str] = frozenset(),
                 lora_runtime: frozenset[str] = frozenset(),
                 fixed_lora: dict[str, int] | None = None, deploy_id: str = "") -> None:
        """``deploy_id``: the deploy's own (unused here: a redeploy changes it, so the
        ingress starts anew with the new board rather than keep its registry)."""
        self.ingress = Ingress(handles, names, board, api_key, prefill=prefill or {},
                               adapters=adapters, runtime=RuntimeAdapters(lora_runtime),
                               fixed_lora=fixed_lora or {})

    def __serve_build_asgi_app__(self) -> Any:
        return disconnect_when_cancelled(create_ingress(self.ingress))


# The deployments, their per-model options given at deploy time (justllm/cluster/deploy.py).
# The ingress and the board only relay and hold: no CPU of their own to reserve.
MODEL: Deployment = serve.deployment()(ModelReplica)
BOARD: Deployment = serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0},
                                     max_ongoing_requests=1000)(StatsBoard)
INGRESS: Deployment = serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})(
    serve.ingress()(ClusterIngress))
