"""`justllm cluster deploy | status | down` against a Ray cluster: which cluster, the app built
from models.yaml, and what is running.

Which cluster: ``RAY_ADDRESS`` when set (as every Ray tool does); else the head `justllm
cluster` started on this machine (justllm/cluster/local_ray.py); else the one ``ray start``
last started here; else, for ``deploy`` only, a new local head. The app is detached: it runs
on the cluster after this command exits, until ``down`` deletes it (and stops the local head
if justllm started it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from justllm.cluster import deployments, local_ray
from justllm.cluster.local_ray import LocalHead, RayUnavailable
from justllm.cluster.options import (
    BOARD,
    GCS_CONNECT_TIMEOUT,
    INGRESS,
    INGRESS_MAX_ONGOING,
    SCHEDULE_TIMEOUT,
    START_TIMEOUT,
    STATS_PERIOD,
    ClusterSettings,
    deployment_name,
    engine_flags,
    model_options,
    model_roles,
    router_kwargs,
    unplaceable,
)
from justllm.cluster.router import JustLLMRouter
from justllm.config import EngineConfig
from justllm.errors import JustLLMError
from justllm.gateway.config import GatewayConfig

EngineConfigFactory = Callable[[str, dict[str, Any]], EngineConfig]
Shield = Callable[[], AbstractContextManager[None]]


class NothingDeployed(JustLLMError):
    """No app of that name on the cluster (or no cluster at all)."""


@dataclass(frozen=True)
class Cluster:
    """The cluster a command talks to, and whether justllm started it here."""

    address: str
    local: LocalHead | None = None
    fresh: bool = False  # the local head was started by this very command
    named: bool = False  # given as RAY_ADDRESS (else found on this machine)


def find_cluster() -> Cluster | None:
    """The cluster to use (module docstring); None when there is none."""
    named = os.environ.get("RAY_ADDRESS")
    if named:
        if named != "auto" and not local_ray.reachable(named):
            raise RayUnavailable(f"cannot reach the Ray cluster at {named} (RAY_ADDRESS): "
                                 "nothing answers there")
        return Cluster(named, named=named != "auto")
    head = local_ray.recorded()
    if head is not None:
        return Cluster(head.address, head)
    found = local_ray.user_head_address()
    return Cluster(found) if found is not None else None


def start_local(shielded: Shield = contextlib.nullcontext) -> Cluster:
    """A new Ray head on this machine, recorded as justllm's (``down`` stops it)."""
    head = local_ray.start_head(shielded=shielded)
    return Cluster(head.address, head, fresh=True)


def find_or_start(on_start: Callable[[], None], settings: ClusterSettings,
                  shielded: Shield = contextlib.nullcontext) -> Cluster:
    """The cluster to deploy onto (``find_cluster``), else a local head started now (after
    ``on_start()``): under a lock, so that deploys at once start one head between them. A
    head is started only for ``settings``' port free (a taken one cost a head's start and
    stop, a minute, before its one line). ``shielded()``: the context the stop of a head
    whose start was interrupted runs in (a second Ctrl-C does not cut it short)."""
    with local_ray.start_lock():
        where = find_cluster()
        if where is None:
            check_port_free(settings)
            on_start()
            where = start_local(shielded)
    return where


@contextmanager
def connected(cluster: Cluster) -> Iterator[None]:
    """A driver connection to ``cluster`` for the block (Ray's and Serve's logs quiet)."""
    logging.getLogger("ray").setLevel(logging.ERROR)
    logging.getLogger("ray.serve").setLevel(logging.ERROR)
    if not cluster.named:
        # As ray.init() finds a cluster on this machine: with the token of Ray's token
        # auth, where there is one. `ray start --head` turns the auth on wherever a token
        # is (~/.ray/auth_token, which any plain ray.init() writes), while ray.init with an
        # address, as here, leaves it off: every connect to the head justllm started failed.
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    refused = gcs_refusal(cluster.address, GCS_CONNECT_TIMEOUT)
    if refused is not None:
        raise RayUnavailable(f"cannot connect to the Ray cluster at {cluster.address}: "
                             f"{refused}")
    try:
        try:
            with _ctrl_c_held():
                ray.init(address=cluster.address, logging_level=logging.ERROR,
                         log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RayUnavailable(f"cannot connect to the Ray cluster at {cluster.address}: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                                 ) from None
        yield
    finally:
        # (after a Ctrl-C held through ray.init too: left to Ray's exit hook, the shutdown
        # waited 6 s on a head stopped by then)
        ray.shutdown()


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """A Ctrl-C while the block runs is raised once it is done: one raised inside ray.init
    (in its core worker's constructor) left Ray half made, and the process died of SIGSEGV
    as it exited. Only in the main thread, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if came and callable(previous):
        previous(signal.SIGINT, None)


def gcs_refusal(address: str, timeout: float) -> str | None:
    """Why ray.init would not connect to the cluster at ``address``, found out within
    ``timeout`` seconds; None when it answers. ray.init has no deadline of its own: to an
    address that accepts TCP and then says nothing (a stopped GCS, a port another program
    holds) it retried for 20 rounds of 40 s, 13 minutes, and to a cluster that wants an auth
    token it does not send, for 20 s, both printing C++ warnings. So first the call it
    begins with (the cluster's id), with a deadline. Any other answer is left to ray.init.
    A Ray Client address (``ray://``), whose server is another gRPC service, is asked only
    for its HTTP/2 handshake; ``auto`` is Ray's to find."""
    import grpc
    from ray._private.gcs_utils import create_gcs_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    if address == "auto":
        return None
    client = address.startswith("ray://")
    target = address.removeprefix("ray://")
    channel = grpc.insecure_channel(target) if client else create_gcs_channel(target)
    silent = (f"it accepts connections but did not answer as Ray does within {timeout:g} s "
              "(a Ray GCS that hangs, or another program on that port)")
    try:
        if client:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        else:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout)
    except grpc.FutureTimeoutError:
        return silent
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return silent
        if (e.code() == grpc.StatusCode.UNAUTHENTICATED
                and os.environ.get("RAY_AUTH_MODE", "").lower() != "token"):
            return ("it wants Ray's auth token: set RAY_AUTH_MODE=token, and the cluster's "
                    "token in RAY_AUTH_TOKEN or ~/.ray/auth_token")
    finally:
        channel.close()
    return None


def build_app(config: GatewayConfig, settings: ClusterSettings, cluster: Cluster,
              engine_config: EngineConfigFactory, *,
              request_router: type | None = JustLLMRouter) -> Any:
    """The Serve application: a deployment per model, the stats board, the ingress.
    ``engine_config(source, flags)`` resolves a model to an EngineConfig; it is sent to the
    replicas and called there, so each resolves the model on its own node.
    ``request_router=None``: Ray's default router (power of two choices), for comparison."""
    url = settings.url
    # Each deploy's own: the board (and with it the registry of LoRA adapters loaded at run
    # time, which an ingress Ray restarts takes back) starts anew at a redeploy, as a
    # restarted vLLM server forgets its runtime loads.
    deploy_id = secrets.token_hex(4)
    board = deployments.BOARD.options(name=BOARD).bind(
        {"url": url, "address": cluster.address, "app": settings.app, "deploy": deploy_id})
    handles = {}
    prefill = {}  # a PD model's prefill deployment, and its prefill-min-tokens
    for spec in config.models:
        routing: dict[str, Any] = {"request_routing_stats_period_s": STATS_PERIOD}
        if request_router is not None:
            routing |= {"request_router_class": request_router,
                        "request_router_kwargs": router_kwargs(spec)}
        router = RequestRouterConfig(**routing)
        for role in model_roles(spec):
            handle = deployments.MODEL.options(
                **model_options(spec, role), request_router_config=router).bind(
                spec.name, partial(engine_config, spec.source, engine_flags(spec)), board, role)
            if role == "prefill":
                prefill[spec.name] = (handle, spec.prefill_min_tokens)
            else:
                handles[spec.name] = handle
    return deployments.INGRESS.options(
        name=INGRESS, max_ongoing_requests=INGRESS_MAX_ONGOING).bind(
        handles, dict(config.names), board, settings.api_key, prefill,
        frozenset(a for m in config.models for a in m.adapters),
        frozenset(m.name for m in config.models if m.lora_runtime),
        {m.name: len(m.adapters) for m in config.models}, deploy_id)


def deploy(config: GatewayConfig, settings: ClusterSettings,
           engine_config: EngineConfigFactory, cluster: Cluster, *,
           request_router: type | None = JustLLMRouter,
           schedule_timeout: float = SCHEDULE_TIMEOUT,
           start_timeout: float = START_TIMEOUT,
           on_wait: Callable[[str], None] = lambda message: None,
           check_here: Callable[[], None] = lambda: None,
           shielded: Shield = contextlib.nullcontext) -> None:
    """Deploy onto ``cluster`` (or redeploy: Ray updates an app of the same name in place)
    and wait until every model's replicas are up (``wait_running``: ``on_wait`` hears why a
    replica waits for a node). ``check_here()`` refuses, before anything is deployed, what
    the replicas would refuse as they start, when they start on this machine: the cluster
    is this machine alone. A local head justllm started, left with nothing on it (the
    deploy failed), is stopped again; so is the head this very deploy started when it is
    interrupted (Ctrl-C), app and all, unless another app has come onto it. That cleanup
    runs in ``shielded()`` (a second Ctrl-C cut it short, and left the head and the app
    running)."""
    try:
        with connected(cluster):
            if this_machine_alone(cluster):
                check_here()
            if not serve_running():
                check_port_free(settings)
            try:
                serve.start(http_options={"host": settings.host, "port": settings.port})
            except Exception as e:  # the port is taken, say (it was a traceback)
                raise JustLLMError(f"Ray Serve cannot listen on {settings.host}:"
                                   f"{settings.port}: {cause(str(e))}") from None
            _check_listening(settings)
            for name, needs in unplaceable(config, cluster_nodes()):
                why = (f"{name}: a replica needs {_resources(needs)}, and no node of the "
                       "cluster has that many")
                if schedule_timeout:  # (0: a cluster whose autoscaler adds nodes)
                    raise JustLLMError(f"the deploy failed: {why} (with --schedule-timeout 0, "
                                       "a cluster that adds nodes may place it later)")
                on_wait(f"{why}: requests for it wait until a node that has joins")
            redeploy = settings.app in serve.status().applications
            try:
                # Not serve.run: it waits without end for replicas no node can hold.
                serve._run(build_app(config, settings, cluster, engine_config,
                                     request_router=request_router),
                           name=settings.app, route_prefix=settings.route_prefix,
                           _blocking=False)
                wait_running(settings.app, schedule_timeout, on_wait,
                             start_timeout=start_timeout)
            except Exception as e:
                if isinstance(e, JustLLMError) and not isinstance(e, DeployFailed):
                    raise
                why = (str(e) if isinstance(e, DeployFailed)
                       else _why_failed(settings.app) or cause(str(e)))
                raise JustLLMError(f"the deploy failed: {why}"
                                   f"{_clear_failed(settings.app, cluster, redeploy)}") from None
    except BaseException as e:
        with shielded():
            if isinstance(e, KeyboardInterrupt):  # (a head that was there before stays)
                if (cluster.fresh and cluster.local is not None
                        and _vacant(cluster, besides=settings.app)):
                    local_ray.stop_head(cluster.local)
            elif cluster.local is not None and _vacant(cluster):
                local_ray.stop_head(cluster.local)
        raise


class DeployFailed(JustLLMError):
    """The app did not come up: why, for "the deploy failed: ..."."""


_POLL = 0.5
# Ray Serve's controller says so in the deployment's message once a replica has waited 30 s
# for a node (ray/serve/_private/deployment_state.py).
_UNPLACED = re.compile(r"has (\d+) replicas that have taken more than [\d.]+s to be scheduled"
                       r".*?Resources required for each replica: (\{.*?\}), total resources "
                       r"available: (\{.*?\})", re.S)
# ... and once a replica has loaded for 30 s without its constructor returning.
_LOADING = re.compile(r"has (\d+) replicas that have taken more than ([\d.]+)s to initialize")


def unplaced(message: str) -> tuple[int, str, str] | None:
    """From a deployment's message: (replicas waiting for a node, what each needs, what the
    cluster has free), or None when the message says nothing of the kind."""
    found = _UNPLACED.search(message)
    return (int(found.group(1)), found.group(2), found.group(3)) if found else None


def loading(message: str) -> tuple[int, str] | None:
    """From a deployment's message: (how many replicas are still in their constructor, the
    model loading, and for more than how many seconds: Ray says so after 30), or None."""
    found = _LOADING.search(message)
    return (int(found.group(1)), found.group(2)) if found else None


def wait_running(app: str, schedule_timeout: float, on_wait: Callable[[str], None], *,
                 start_timeout: float = 0.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
    """Until ``app`` runs. A DeployFailed when a deployment failed, or when replicas still
    wait for a node after ``schedule_timeout`` seconds (no node has the CPUs or GPUs one
    asks for: with ``gpu: true`` on a cluster without GPUs, say; serve.run waited for ever,
    and requests with it), or are still loading their model after ``start_timeout`` (a
    constructor that hangs: a model file on a stalled network mount, say; Ray waits for it
    without end, and the deploy did). A cluster whose autoscaler adds nodes may need longer;
    0 waits without end. ``on_wait`` hears each deployment's wait once."""
    start = clock()
    told: set[tuple[str, str]] = set()
    while True:
        found = serve.status().applications.get(app)
        if found is None:
            raise DeployFailed(f"the app '{app}' was deleted while it deployed")
        state = str(found.status.value)
        if state == "RUNNING":
            return
        if state == "DEPLOY_FAILED":  # as serve.run: an unhealthy replica is retried
            raise DeployFailed(_why_failed(app) or "Ray gave no reason")
        messages = [(name, dep.message) for name, dep in found.deployments.items()
                    if dep.message]
        waiting = [(name, why) for name, message in messages if (why := unplaced(message))]
        limit = (f" (waiting up to {schedule_timeout:g} s: --schedule-timeout)"
                 if schedule_timeout else "")
        for name, (count, needs, free) in waiting:
            if (name, "node") not in told:
                told.add((name, "node"))
                on_wait(f"{name}: {count} replica(s) wait for a node with {needs}; the "
                        f"cluster has {free}{limit}")
        slow = [(name, *load) for name, message in messages
                if (load := loading(message)) is not None]
        for name, count, since in slow:
            if (name, "load") not in told:
                told.add((name, "load"))
                until = (f"waiting up to {start_timeout:g} s in all: --start-timeout"
                         if start_timeout else "waiting without end: --start-timeout 0")
                # (the ingress and the board load no model: "still loading their model"
                # blamed the ingress for a model replica's wait)
                what = "starting" if name in (INGRESS, BOARD) else "loading their model"
                on_wait(f"{name}: {count} replica(s) still {what} after more than {since} s "
                        f"({until})")
        if waiting and schedule_timeout and clock() - start >= schedule_timeout:
            name, (count, needs, free) = waiting[0]
            raise DeployFailed(f"{name}: {count} replica(s) found no node in "
                               f"{schedule_timeout:g} s: each needs {needs}, the cluster has "
                               f"{free} (a cluster that adds nodes may need a longer "
                               "--schedule-timeout)")
        if slow and start_timeout and clock() - start >= start_timeout:
            name, count, _ = slow[0]
            raise DeployFailed(f"{name}: {count} replica(s) did not finish loading their "
                               f"model in {start_timeout:g} s (its log, in Ray's logs/serve "
                               "folder on its node, says how far it got; a larger "
                               "--start-timeout waits longer)")
        sleep(_POLL)


def serve_address() -> tuple[str, int]:
    """Where the cluster's Serve proxies listen. Set when Serve first starts: serve.start
    with other options keeps them, with only a log line (ray/serve/_private/api.py)."""
    from ray.serve.context import _get_global_client

    config = _get_global_client().http_config
    return str(config.host), int(config.port)


def cluster_nodes() -> list[dict[str, float]]:
    """Each live node's total resources (CPU, GPU, memory...)."""
    return [dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")]


def this_machine_alone(cluster: Cluster) -> bool:
    """The connected cluster is one node, this machine: a driver runs on a node of its
    cluster (ray.init connects it to that node's raylet), but for a Ray Client's."""
    return not cluster.address.startswith("ray://") and len(cluster_nodes()) == 1


def _resources(needs: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" + ("s" if k == "CPU" and v != 1 else "")
                     for k, v in needs.items())


def serve_running() -> bool:
    """Ray Serve runs on the connected cluster (its controller is up)."""
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False) is not None


def check_port_free(settings: ClusterSettings) -> None:
    """Before Serve first starts on a cluster: nothing may listen on its address already.
    Ray Serve's proxies bind with SO_REUSEPORT, so a port another cluster's Serve (or any
    server that does the same) holds was shared without a word, the kernel splitting the
    connections between the two."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(settings.host, settings.host)
    if not local_ray.reachable(f"{host}:{settings.port}", timeout=1):
        return
    raise JustLLMError(f"something already listens on {settings.host}:{settings.port} "
                       "(another Ray cluster's Serve, or another server): Ray Serve would "
                       "share the port with it; pick another --port")


def _check_listening(settings: ClusterSettings) -> None:
    """A deploy asking for another --host or --port than Serve already has is refused (the
    app would answer on the old address while the command named the new one)."""
    host, port = serve_address()
    if (host, port) != (settings.host, settings.port):
        raise JustLLMError(
            f"Ray Serve on this cluster already listens on {host}:{port} (it keeps the address "
            f"it started with): deploy with --host {host} --port {port}, or 'justllm cluster "
            "down' every app first to move it")


_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception)): (.+)$")


def cause(text: str) -> str:
    """What went wrong, from a Ray error's text (a traceback, colours, an actor's header): the
    last ``SomeError: message`` line, else the first line."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", x).strip() for x in text.splitlines()]
    lines = [x for x in lines if x]
    found = [m for x in lines if (m := _ERROR_LINE.match(x))]
    if found:
        return f"{found[-1].group(1)}: {found[-1].group(2)}"
    return lines[0] if lines else "no reason given"


def _why_failed(app: str) -> str | None:
    """The first failed deployment of ``app`` and the cause Ray recorded for it."""
    found = serve.status().applications.get(app)
    for name, dep in (found.deployments.items() if found is not None else ()):
        if dep.message and str(dep.status.value) in ("DEPLOY_FAILED", "UNHEALTHY"):
            return f"{name}: {cause(dep.message)}"
    return found.message if found is not None and found.message else None


def _clear_failed(app: str, cluster: Cluster, redeploy: bool = False) -> str:
    """After a failed deploy: the failed app alone on a local head justllm started, made by
    this deploy, is deleted (the head is then stopped: nothing is left on it); anywhere
    else it stays, and the message says how to remove it (it was left, head and all,
    without a word). A failed ``redeploy`` stays too: the app ran before it (a failed
    redeploy deleted it and stopped the head under it)."""
    apps = serve.status().applications
    if app not in apps:  # refused before Ray made it (a route prefix in use, say)
        return ""
    if cluster.local is not None and not redeploy and set(apps) <= {app}:
        with contextlib.suppress(Exception):
            serve.delete(app)
            return ""
    return (f" (the failed app stays on the cluster, answering nothing: 'justllm cluster "
            f"down --name {app}' removes it)")


def _vacant(cluster: Cluster, besides: str | None = None) -> bool:
    """No app but ``besides`` runs on ``cluster``; Serve is then shut down, ``besides``
    with it, as ``down`` does before it stops the head (Ray drained its replicas for 30 s
    otherwise)."""
    try:
        with connected(cluster):
            if set(serve.status().applications) - {besides}:
                return False
            serve.shutdown()
    except Exception:
        pass
    return True


def status(app: str) -> dict[str, Any]:
    """What the app runs: per model its deployment's state and replica counts and each
    replica's last report (node, health, load, KV use, hit ratio, TTFT)."""
    cluster = find_cluster()
    if cluster is None:
        raise NothingDeployed("nothing deployed: no Ray cluster (RAY_ADDRESS is not set and no "
                              "local Ray runs here)")
    with connected(cluster):
        found = serve.status().applications.get(app)
        if found is None:
            raise NothingDeployed(f"nothing deployed as '{app}' on the Ray cluster at "
                                  f"{cluster.address}")
        if BOARD not in found.deployments:  # (a KeyError traceback)
            raise NothingDeployed(f"'{app}' on the Ray cluster at {cluster.address} is not "
                                  "an app justllm deployed (it has no stats board)")
        board = serve.get_deployment_handle(BOARD, app_name=app)
        try:
            snapshot = board.snapshot.remote().result(timeout_s=30)
            info = board.about.remote().result(timeout_s=30)
        except Exception as e:  # a board that does not answer: Ray's timeout, a dead actor
            raise RayUnavailable(f"the stats board of '{app}' did not answer: "
                                 f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                                 ) from None
    models = []
    for name, dep in found.deployments.items():
        if not name.startswith("model-"):
            continue
        # A PD model has two deployments: model-NAME-prefill and model-NAME (decode).
        prefill = any(deployment_name(m, "prefill") == name for m in snapshot)
        model = next((m for m in snapshot if deployment_name(
            m, "prefill" if prefill else "both") == name), name.removeprefix("model-"))
        rows = sorted((r for r in (snapshot.get(model) or {}).values()
                       if (r["stats"].get("role") == "prefill") == prefill),
                      key=lambda r: r["stats"]["replica"])
        role = "prefill" if prefill else rows[0]["stats"].get("role", "both") if rows else "both"
        models.append({"model": model, "deployment": name, "status": str(dep.status.value),
                       "role": role,
                       "replica_states": {str(k): v for k, v in dep.replica_states.items()},
                       "message": cause(dep.message) if dep.message else "",
                       "replicas": [{**row["stats"], "age": row["age"]} for row in rows]})
    return {"app": app, "status": str(found.status.value),
            "message": cause(found.message) if found.message else "",
            "address": cluster.address, "local": cluster.local is not None,
            "url": info.get("url"), "models": models}


def down(app: str) -> list[str]:
    """Delete the app (and Serve, when no other app is left); stop the local head justllm
    started once nothing else runs on it. What was done, for the user. An app that is not
    there is a NothingDeployed, and the others keep running."""
    cluster = find_cluster()
    if cluster is None:
        raise NothingDeployed("nothing deployed: no Ray cluster (RAY_ADDRESS is not set and no "
                              "local Ray runs here)")
    done: list[str] = []
    with connected(cluster):
        apps = serve.status().applications
        others = sorted(set(apps) - {app})
        if app in apps:
            serve.delete(app)
            done.append(f"deleted the app '{app}'")
            if not others:
                serve.shutdown()
        elif others:  # a mistyped --name stopped the local head under every other app
            raise NothingDeployed(f"nothing deployed as '{app}' on the Ray cluster at "
                                  f"{cluster.address} (it runs: {', '.join(others)})")
    if cluster.local is not None and not others:
        local_ray.stop_head(cluster.local)
        done.append(f"stopped the local Ray head at {cluster.address}")
    elif cluster.local is not None:
        done.append(f"the local Ray head at {cluster.address} keeps running: it serves "
                    f"{', '.join(others)}")
    if not done:
        raise NothingDeployed(f"nothing deployed as '{app}' on the Ray cluster at "
                              f"{cluster.address}")
    return done
