"""models.yaml, as the gateway parses it, turned into Ray Serve deployment options: the one
place where a justllm model entry meets Ray's vocabulary. Pure (no ``ray``), so the mapping is
tested alone.

    replicas: N                        -> num_replicas: N
    min-replicas / max-replicas        -> autoscaling_config min_replicas / max_replicas
    target-ongoing                     -> autoscaling_config target_ongoing_requests
    upscale-delay / downscale-delay    -> autoscaling_config upscale_delay_s / downscale_delay_s
    threads: N (engine flag)           -> ray_actor_options num_cpus: N (and N threads)
    gpus: [...] or gpu: true           -> ray_actor_options num_gpus: 1 (Ray picks the device)
    routing                            -> request_router_kwargs (justllm's RoutingConfig)
    max-seqs + max-queue               -> max_ongoing_requests

The autoscaler's rule is Ray's own (justllm's local autoscaler copies it), so the fields map
one to one. A replica takes as many requests as its engine can hold (running + queued): beyond
that Ray holds them in the router, which beats a 429 from the engine.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from justllm.config import EngineConfig
from justllm.gateway.config import DEFAULT_TTL, GatewayConfig, ModelSpec

APP_NAME = "justllm"
INGRESS = "ingress"
BOARD = "stats"
STATS_PERIOD = 1.0  # seconds between a replica's reports (routing stats, the stats board)
HEALTH_PERIOD = 5.0  # seconds between check_health calls
HEALTH_TIMEOUT = 30.0  # Ray's default: a replica that does not answer for this long is dead
DRAIN = 5.0  # seconds a stopping replica lets its requests run (`justllm serve`'s default)
INGRESS_MAX_ONGOING = 10_000  # the ingress only relays: it never holds requests back
# How long `justllm cluster` waits for a cluster's GCS to answer before giving up on it.
GCS_CONNECT_TIMEOUT = 15.0
# How long a deploy waits for replicas that Ray can place on no node (0: without end).
SCHEDULE_TIMEOUT = 120.0
# How long a deploy waits for replicas still loading their model (0: without end): as long
# as router mode lets a runner start (gateway/policy.py RUNNER_START_LIMIT).
START_TIMEOUT = 600.0


@dataclass(frozen=True)
class ClusterSettings:
    """Where the app lives on the cluster and how it is reached."""

    app: str = APP_NAME
    host: str = "127.0.0.1"  # the Serve HTTP proxies bind here (0.0.0.0: every interface)
    port: int = 8000  # Ray Serve's default
    api_key: str | None = None  # the ingress asks for 'Authorization: Bearer KEY' on /v1
    # Where the app's routes begin on the proxies (Ray Serve's route_prefix): several apps
    # share a cluster's proxies, each under its own prefix.
    route_prefix: str = "/"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.app):
            raise ValueError(f"the app name must be letters, digits, '_', '.' or '-' "
                             f"(got {self.app!r})")
        if not re.fullmatch(r"/|(/[A-Za-z0-9_.~-]+)+", self.route_prefix):
            raise ValueError("--route-prefix must be '/' or '/' and path segments of letters, "
                             f"digits, '_', '.', '~' or '-', without a trailing '/' (got "
                             f"{self.route_prefix!r})")
        if not 0 < self.port < 65536:
            raise ValueError("--port must be in 1..65535")
        if not self.host.strip():  # (as `serve` refuses it: Ray's proxies took it as any)
            raise ValueError("--host is empty: give the address Ray Serve's proxies listen on "
                             "(127.0.0.1, the default, or 0.0.0.0 for every interface)")

    @property
    def url(self) -> str:
        """Where clients reach the app (its /v1, /api, /metrics and /health are under it)."""
        prefix = "" if self.route_prefix == "/" else self.route_prefix
        return f"http://{self.host}:{self.port}{prefix}"


def deployment_name(model: str, role: str = "both") -> str:
    """A model's deployment: ``model-NAME`` with anything Ray's names refuse (``#``, ``/``,
    ``:``...) as ``-``; a PD model's prefill deployment is ``model-NAME-prefill``."""
    return ("model-" + re.sub(r"[^A-Za-z0-9_.-]", "-", model)
            + ("-prefill" if role == "prefill" else ""))


def check_supported(config: GatewayConfig) -> list[str]:
    """Refuse what has no meaning on Ray (a ValueError naming the model and the key); return
    warnings for router-mode settings a cluster ignores."""
    for m in config.models:
        if m.urls:
            raise ValueError(f"model '{m.name}': urls are router mode's (replicas elsewhere); "
                             "on a Ray cluster every replica is a Ray actor: give replicas "
                             "or min-replicas / max-replicas")
        if not m.source:
            raise ValueError(f"model '{m.name}' needs a 'source'")
    # Ray renamed a second deployment of one name (model-a-b_1), which status then showed as
    # a model of its own: a/b and a:b, or x-prefill beside a PD model x
    named: dict[str, str] = {}
    for m in config.models:
        for role in model_roles(m):
            deployment = deployment_name(m.name, role)
            if deployment in named:
                raise ValueError(f"models '{named[deployment]}' and '{m.name}' would both be "
                                 f"the Ray deployment {deployment} (characters Ray refuses "
                                 "become '-', and a PD model's prefill is NAME-prefill): "
                                 "rename one")
            named[deployment] = m.name

    def ignored(name: str, why: str = "replicas stay loaded; min-replicas: 0 lets Ray scale a "
                "model to zero") -> str:
        return f"{name} is router mode's: a Ray cluster ignores it ({why})"

    warnings = [ignored(name) for name, value in (("max-loaded", config.max_loaded),
                                                  ("max-memory", config.max_memory)) if value]
    # Router mode's loading and polling: Ray keeps replicas up and routes by its own stats.
    defaults = GatewayConfig.__dataclass_fields__
    warnings += [ignored(key.replace("_", "-"), "Ray starts every replica at deploy and keeps "
                         "it up; its own health checks restart a replica") for key in (
                             "load_timeout", "max_waiting", "poll_interval", "health_timeout")
                 if getattr(config, key) != defaults[key].default]
    for m in config.models:
        warnings += [ignored(f"model '{m.name}': {name}", why) for name, given, why in (
            ("ttl", m.ttl != DEFAULT_TTL and not m.pinned,  # (a pinned model's ttl is -1)
             "Ray scales a min-replicas: 0 model to zero after its downscale-delay"
             if m.autoscale is not None else "replicas stay loaded; min-replicas: 0 lets Ray "
             "scale a model to zero"),
            ("preload", m.preload and not m.pinned, "Ray starts every replica at deploy"))
            if given]
    return warnings


def engine_flags(spec: ModelSpec) -> dict[str, Any]:
    """The model's engine flags under their parameter names (``max_seqs``), as the command line
    hands them to ``engine_config``; a replica without ``threads`` gets one thread per CPU Ray
    reserves for it (one), not every core of a node it shares."""
    flags = {key.replace("-", "_"): value for key, value in spec.flags}
    if not flags.get("threads"):
        flags["threads"] = _cpus(flags)
    return flags


def _cpus(flags: dict[str, Any]) -> int:
    threads = flags.get("threads")
    return threads if isinstance(threads, int) and threads > 0 else 1


def model_roles(spec: ModelSpec) -> tuple[str, ...]:
    """The deployments of a model, by role: "both" (one), or a PD model's "prefill" and
    "decode" (two, each with its own replica count or autoscaling)."""
    return ("prefill", "decode") if spec.pd else ("both",)


def model_options(spec: ModelSpec, role: str = "both") -> dict[str, Any]:
    """The keyword arguments of ``Deployment.options`` for one model (for a PD model, for
    one ``role``'s deployment: ``model-NAME-prefill`` or ``model-NAME``), but the request
    router (a Ray class: see ``router_kwargs`` and justllm/cluster/deploy.py)."""
    flags = engine_flags(spec)
    defaults = EngineConfig()
    holds = (int(flags.get("max_seqs", defaults.max_seqs))
             + int(flags.get("max_queue", defaults.max_queue)))
    options: dict[str, Any] = {
        "name": deployment_name(spec.name, role),
        "ray_actor_options": {"num_cpus": _cpus(flags),
                              "num_gpus": 1 if spec.gpus or flags.get("gpu") else 0},
        "max_ongoing_requests": max(1, holds),
        "health_check_period_s": HEALTH_PERIOD,
        "health_check_timeout_s": HEALTH_TIMEOUT,
        "graceful_shutdown_wait_loop_s": 1.0,
        "graceful_shutdown_timeout_s": DRAIN,
    }
    scale = spec.autoscale if role == "both" else dict(spec.role_autoscale).get(role)
    if scale is None:
        options["num_replicas"] = (spec.replicas if role == "both"
                                   else spec.roles.count(role))
    else:
        options["autoscaling_config"] = {
            "min_replicas": scale.min_replicas, "max_replicas": scale.max_replicas,
            "target_ongoing_requests": scale.target_ongoing,
            "upscale_delay_s": scale.upscale_delay, "downscale_delay_s": scale.downscale_delay}
    return options


def unplaceable(config: GatewayConfig, nodes: list[dict[str, float]]
                ) -> list[tuple[str, dict[str, float]]]:
    """The deployments whose replica no node of ``nodes`` (each node's total resources, as
    ``ray.nodes()`` gives them) could ever hold, with what one replica needs. A model that
    starts no replica at deploy (``min-replicas: 0``) deployed, and each request for it then
    waited for a node without end."""
    found = []
    for spec in config.models:
        for role in model_roles(spec):
            options = model_options(spec, role)
            actor = options["ray_actor_options"]
            needs = {"CPU": float(actor["num_cpus"])} | (
                {"GPU": float(actor["num_gpus"])} if actor["num_gpus"] else {})
            if not any(all(node.get(k, 0.0) >= v for k, v in needs.items()) for node in nodes):
                found.append((options["name"], needs))
    return found


def router_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """The model's routing options as the RequestRouter's ``initialize_state`` gets them
    (JSON, as Ray requires): RoutingConfig's fields by name. The cluster's router takes the
    built-in policies only (a plugin's class would have to reach Ray's controller)."""
    kwargs = asdict(spec.routing)
    kwargs.pop("policy_class")
    return kwargs
