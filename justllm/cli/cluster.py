"""``justllm cluster deploy | status | down``: models on a Ray cluster with Ray Serve.

Ray is imported only inside the commands, so ``justllm --help`` works without the extra; a
command without it says which one to install.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from justllm.cli.cleanup_shield import CleanupShield
from justllm.cli.errors import cli_errors
from justllm.cli.group import OneLineSummaries
from justllm.cluster.options import SCHEDULE_TIMEOUT, START_TIMEOUT
from justllm.config import read_yaml
from justllm.errors import JustLLMError

if TYPE_CHECKING:
    from justllm.gateway.config import GatewayConfig
    from justllm.plugins import Plugins

app = typer.Typer(help="Serve models on a Ray cluster with Ray Serve (pip install "
                       "'justllm\\[cluster]'): the cluster is RAY_ADDRESS, or a local Ray.",
                  no_args_is_help=True, cls=OneLineSummaries,
                  context_settings={"help_option_names": ["-h", "--help"]})

AppName = Annotated[str, typer.Option("--name", help="The Serve application's name.", envvar="JUSTLLM_CLUSTER_APP")]


@contextmanager
def _errors() -> Iterator[None]:
    """``cli_errors`` with its message on one line (Ray's errors span several)."""
    with cli_errors():
        try:
            yield
        except (JustLLMError, ValueError) as e:
            one_line = " ".join(x.strip() for x in str(e).splitlines() if x.strip())
            raise ValueError(one_line) from None


def _cluster() -> ModuleType:
    """justllm/cluster/deploy.py, or the one-line error that names the extra."""
    try:
        import ray.serve  # noqa: F401
    except ImportError as e:
        missing = getattr(e, "name", None) or "ray"
        raise ValueError(f"`justllm cluster` needs Ray Serve ({missing} is not installed): "
                         "pip install 'justllm[cluster]'") from None
    from justllm.cluster import deploy

    return deploy


@app.command("deploy")
def deploy(
    context: typer.Context,
    config_file: Annotated[str, typer.Argument(help="The models, as router mode's models.yaml: source, engine flags, replicas or min-replicas / max-replicas, target-ongoing, delays, gpus, routing.", metavar="CLUSTER_YAML", show_default=False)],
    host: Annotated[str, typer.Option("--host", help="Address Ray Serve's HTTP proxies bind on every node (0.0.0.0: reachable from other machines).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port of Ray Serve's HTTP proxies.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Require the key on every route but /health, /metrics, /docs and / ('Authorization: Bearer KEY' or 'x-api-key: KEY').", envvar="JUSTLLM_API_KEY")] = None,
    name: AppName = "justllm",
    route_prefix: Annotated[str, typer.Option("--route-prefix", help="Where the app's routes begin on Ray Serve's proxies (/v1, /api, /metrics, /health under it): several apps, each deployed with its own --name and prefix, share one cluster.")] = "/",
    schedule_timeout: Annotated[float, typer.Option("--schedule-timeout", help="Seconds to wait for replicas that no node has the CPUs or GPUs for, before the deploy fails (0: wait for ever, for a cluster whose autoscaler adds nodes).", min=0)] = SCHEDULE_TIMEOUT,
    start_timeout: Annotated[float, typer.Option("--start-timeout", help="Seconds to wait for replicas still loading their model (a constructor that hangs), before the deploy fails (0: wait for ever).", min=0)] = START_TIMEOUT,
) -> None:
    """Deploy every model of CLUSTER_YAML as a Ray Serve deployment, behind one ingress that
    speaks the OpenAI API; wait until their replicas are up. Onto RAY_ADDRESS, else the Ray
    started on this machine, else a local Ray head started now (`cluster down` stops it)."""
    with _errors():
        cluster = _cluster()
        from justllm.cli import options as o
        from justllm.cli.plugins import plugins_of
        from justllm.cli.serve import check_entry_flags
        from justllm.cluster.options import ClusterSettings, check_supported
        from justllm.gateway.config import Flags, load_config

        # a spec method a plugin adds is one the replicas (justllm serve) take too
        known = Flags(o.YAML_FLAGS, switches=o.YAML_SWITCHES,
                      spec_methods=plugins_of(context).spec_methods)
        config = load_config(read_yaml(config_file), known, str(config_file))
        check_entry_flags(config.models, plugins_of(context))  # (as router mode's runners)
        warnings = check_supported(config)
        settings = ClusterSettings(name, host, port, api_key, route_prefix)
        console = Console(stderr=True, emoji=False, soft_wrap=True)
        for warning in warnings:
            console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)

        def check_here() -> None:  # (replicas on this machine: its files are theirs)
            _check_local_replicas(config, plugins_of(context))

        def on_start() -> None:
            check_here()  # (before a head's minute to start and stop)
            console.print("justllm: no Ray cluster (RAY_ADDRESS is not set and none runs "
                          "here): starting a local Ray head", highlight=False)

        with CleanupShield(lambda: console.print(
                "justllm: undoing what the deploy started first (stopping a Ray head takes "
                "up to a minute); Ctrl-C again does not cut that short",
                highlight=False)) as shield:
            where = cluster.find_or_start(on_start, settings, shield.shielded)
            names = ", ".join(m.name for m in config.models)
            console.print(f"justllm: deploying {names} onto the Ray cluster at "
                          f"{where.address} (each replica loads its model on its node; this "
                          "waits for them)", highlight=False)
            try:
                cluster.deploy(config, settings, o.engine_config, where,
                               schedule_timeout=schedule_timeout, start_timeout=start_timeout,
                               on_wait=lambda why: console.print(
                                   f"[yellow]waiting:[/yellow] {escape(why)}",
                                   highlight=False),
                               check_here=check_here, shielded=shield.shielded)
            except KeyboardInterrupt:
                if not where.fresh:  # (a head this deploy started is stopped, app and all)
                    console.print(f"justllm: the Ray cluster at {where.address} keeps what "
                                  f"Ray made of '{name}' so far (`justllm cluster status "
                                  f"--name {name}` shows it, `cluster down` removes it)",
                                  highlight=False)
                raise
        local = (" (a local Ray head justllm started: `justllm cluster down` stops it)"
                 if where.local is not None else "")
        console.print(f"justllm: '{name}' runs on the Ray cluster at {where.address}{local}; "
                      f"OpenAI API at {settings.url}/v1, /metrics, /health",
                      highlight=False)


def _check_local_replicas(config: GatewayConfig, plugins: Plugins) -> None:
    """What replicas started on this machine would refuse as they load, asked as router mode
    asks it of its runners, and a GGUF that is not whole as `justllm serve` asks it: each
    failed only inside the replicas, Ray retrying them for a minute before the deploy said
    why. (On a cluster of several machines each node resolves the files on its own.)"""
    from justllm.cli.serve import check_local_engines
    from justllm.gateway.config import check_sources, gguf_path
    from justllm.models.gguf import read_gguf_header

    check_sources(config)
    check_local_engines(config.models, plugins)
    for m in config.models:
        path = gguf_path(m.source)
        if path is not None:
            try:
                read_gguf_header(path, vocabulary=False)
            except JustLLMError as e:
                raise ValueError(f"model '{m.name}': {e}") from None


def _deployment_label(m: dict) -> str:
    """A model as `cluster status` shows it: a PD model's deployments with their role after
    the name ("demo (prefill)")."""
    role = m.get("role", "both")
    return m["model"] if role == "both" else f"{m['model']} ({role})"


@app.command("status")
def status(
    name: AppName = "justllm",
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False,
) -> None:
    """Per model: the deployment's state and, per replica, its node, health, load (running,
    waiting), KV use, prefix-cache hit ratio, recent TTFT and the LoRA adapters it holds."""
    with _errors():
        body = _cluster().status(name)
        if as_json:
            print(json.dumps(body, indent=2))
            return
        console = Console(emoji=False) if sys.stdout.isatty() else Console(width=200, emoji=False)
        local = " (local head)" if body["local"] else ""
        console.print(f"app '{body['app']}' {body['status']} on the Ray cluster at "
                      f"{body['address']}{local} · {body.get('url') or ''}", highlight=False,
                      markup=False, soft_wrap=True)
        table = Table("MODEL", "REPLICA", "NODE", "STATE", "RUNNING", "WAITING", "KV", "HIT",
                      "TTFT", "ADAPTERS", box=None, pad_edge=False)
        for m in body["models"]:
            name = _deployment_label(m)
            for r in m["replicas"]:
                table.add_row(
                    name, r["replica"], r["node_ip"] or r["node_id"][:8],
                    "healthy" if r["healthy"] else "engine down", str(r["running"]),
                    str(r["waiting"]), f"{r['kv_usage']:.0%}",
                    "-" if r["hit_ratio"] is None else f"{r['hit_ratio']:.0%}",
                    "-" if r["ttft_p50"] is None else f"{r['ttft_p50'] * 1000:.0f} ms",
                    ",".join(r.get("adapters") or []) or "-")
            reporting = len(m["replicas"])
            running = m["replica_states"].get("RUNNING", 0)
            if running > reporting:
                table.add_row(name, f"({running - reporting} more)", "-",
                              "not reporting yet", "-", "-", "-", "-", "-", "-")
        console.print(table)
        for m in body["models"]:
            states = ", ".join(f"{k.lower()} {v}" for k, v in sorted(m["replica_states"].items()))
            note = f": {escape(m['message'])}" if m["message"] else ""  # (Ray's own words)
            console.print(f"[dim]{_deployment_label(m)}: {m['status'].lower()}, Ray replicas "
                          f"{states or 'none'}{note}[/dim]", highlight=False, soft_wrap=True)


@app.command("down")
def down(name: AppName = "justllm") -> None:
    """Delete the app from the Ray cluster (and Ray Serve, when no other app is left); stop
    the local Ray head if `justllm cluster deploy` started it."""
    with _errors():
        for line in _cluster().down(name):
            Console(stderr=True, emoji=False, soft_wrap=True).print(f"justllm: {line}", highlight=False)
