"""What one model replica runs on its Ray node, without Ray: justllm's engine on its own
thread (as ``justllm serve`` runs it), the server's whole Litestar app in front of it, and the
replica's view of itself that the router and the stats board are given.

The Ray deployment (justllm/cluster/deployments.py) only wires this to Ray: each call of its
``http`` method is one request through :func:`call_asgi`; ``check_health`` and
``record_routing_stats`` are the methods below.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from justllm.cluster.asgi import Head, call_asgi
from justllm.config import EngineConfig
from justllm.engine.async_engine import AsyncEngine
from justllm.engine.engine import Engine
from justllm.gateway.replica import Replica
from justllm.server.app import ServerConfig, create_app
from justllm.tui.metrics import parse as parse_metrics

REPLICA_HEADER = "x-replica"  # the gateway's: which replica served the answer


class EngineUnhealthy(RuntimeError):
    """The engine thread is dead or has not come round for the health check's timeout."""


@dataclass(frozen=True)
class Identity:
    """Who a replica is: its model, Ray Serve's replica id and the node it runs on."""

    model: str
    replica: str
    node_id: str = ""
    node_ip: str = ""
    role: str = "both"  # prefill/decode disaggregation: the server's --role


class EngineHost:
    """One model's engine and app in this process. ``close`` stops the engine thread and
    frees the model; the owner (the replica) calls it when Ray stops the replica."""

    def __init__(self, identity: Identity, aengine: AsyncEngine, *,
                 health_timeout: float = 20.0) -> None:
        self.identity = identity
        self.aengine = aengine
        self.health_timeout = health_timeout
        self.app = create_app(aengine, ServerConfig(model_name=identity.model,
                                                    role=identity.role))
        # The gateway's bookkeeping of a replica, fed the same /metrics page it would poll:
        # load, KV use, hit ratio and the recent TTFT are computed once, the same way.
        self.view = Replica(identity.replica)
        self.started = time.time()
        self.healthy = True  # the last health check passed (none yet: the engine just started)

    @classmethod
    def load(cls, identity: Identity, engine_config: Callable[[], EngineConfig]) -> EngineHost:
        """Resolve the model on this node (a path, a registry ``name:tag``, a Hugging Face
        ``REPO:FILE`` pulled into this node's models directory), load it and start the engine
        thread. Blocks for the load: call it off the event loop."""
        return cls(identity, AsyncEngine(Engine(engine_config())))

    async def http(self, method: str, path: str, query: str = "",
                   headers: list[tuple[str, str]] | None = None,
                   body: bytes = b"") -> AsyncIterator[Head | bytes]:
        """One request through the app; the answer's head says which replica served it."""
        async for item in call_asgi(self.app, method, path, query=query, headers=headers,
                                    body=body):
            if isinstance(item, Head):
                item = Head(item.status, [*item.headers,
                                          (REPLICA_HEADER, self.identity.replica)])
            yield item

    async def check_health(self) -> None:
        """Raises :class:`EngineUnhealthy` unless the engine thread runs a job between two
        steps within ``health_timeout`` (so a thread that died, or hangs in a step, fails)."""
        # (healthy stays as it was while the check waits: a busy step is no failure, and
        # replica_up flickered to 0 on replicas serving requests)
        if not self.aengine.accepting:
            self.healthy = False
            raise EngineUnhealthy("the engine is closed")
        try:
            await asyncio.wait_for(self.aengine.call_on_engine_thread(lambda: None),
                                   self.health_timeout)
        except TimeoutError:
            self.healthy = False
            raise EngineUnhealthy(f"the engine thread has not come round for "
                                  f"{self.health_timeout:g} s (dead or stuck)") from None
        self.healthy = True

    def page(self) -> str:
        """The replica's own /metrics page (model_name = the model's name)."""
        return self.app.state["served"].metrics.render().decode()

    def observe(self) -> tuple[dict[str, Any], str]:
        """The replica's stats now (what ``record_routing_stats`` returns and the stats board
        shows) and the /metrics page they were read from."""
        page = self.page()
        snap = parse_metrics(page, time.monotonic())
        view = self.view
        view.observe(snap)
        return {
            "model": self.identity.model, "replica": self.identity.replica,
            "node_id": self.identity.node_id, "node_ip": self.identity.node_ip,
            "role": self.identity.role,
            "pid": os.getpid(), "started": self.started,
            "healthy": self.healthy and self.aengine.accepting,
            "running": view.running, "waiting": max(0, view.others - view.running),
            "kv_usage": round(view.kv_usage, 4),
            "hit_ratio": None if view.hit_ratio is None else round(view.hit_ratio, 4),
            "cache_blocks": int(snap.cache_blocks or 0), "ttft_p50": view.ttft_p50,
            "adapters": sorted(a.name for a in self.aengine.lora_adapters()),
            "max_model_len": self.aengine.max_request_tokens,
        }, page

    def close(self) -> None:
        self.aengine.close()
