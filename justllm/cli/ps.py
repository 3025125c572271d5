"""``justllm ps`` and ``justllm logs``: what a router-mode gateway runs, and its runners' logs."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from justllm.cli.errors import cli_errors

Url = Annotated[str, typer.Option("--url", help="The gateway (justllm serve --models ...).")]
ApiKey = Annotated[Optional[str], typer.Option("--api-key", envvar="JUSTLLM_API_KEY", help="Sent as 'Authorization: Bearer KEY'.")]


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 0:
        return "never"
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.0f} min"


def ps(url: Url = "http://127.0.0.1:8080", api_key: ApiKey = None) -> None:
    """Show a gateway's models, one row per replica: status, pid, memory, load (running +
    waiting), KV use, prefix-cache hit ratio, recent TTFT, idle time, time until unload."""
    with cli_errors():
        import httpx

        from justllm.chat.backends import check_url

        check_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            r = httpx.get(url.rstrip("/") + "/models", headers=headers, timeout=10,
                          trust_env=False)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach {url}: {e}") from None
        if r.status_code == 401:
            raise ValueError(f"{url} wants an API key: pass --api-key (or set JUSTLLM_API_KEY)"
                             if not api_key else f"{url} refused the API key given")
        body = _gateway_listing(r)
        if body is None:
            hint = (" (give the gateway's address without /v1: ps reads its own /models)"
                    if url.rstrip("/").endswith("/v1") else "")
            raise ValueError(f"{url} is not a router-mode gateway (GET /models answered "
                             f"{r.status_code}, not with the gateway's model list){hint}; "
                             "`justllm ps` needs `justllm serve --models`")
        table = Table("MODEL", "REPLICA", "STATUS", "PID", "MEMORY", "LOAD", "KV", "HIT",
                      "TTFT", "IDLE", "UNLOAD IN", "RESTARTS", box=None, pad_edge=False)
        for m in body["data"]:
            loaded = m["status"] == "loaded"
            idle = _seconds(m["idle_seconds"]) if loaded else "-"
            unload = (_seconds(m["unload_in"]) if loaded and m["unload_in"] is not None
                      else ("never" if m["ttl"] < 0 else "-"))
            replicas = m.get("replicas") or []
            if not replicas:
                status = m["status"] + (f" ({m['error']})" if m.get("error") else "")
                table.add_row(m["model"], "-", status, "-", "-", str(m["active"]), "-", "-",
                              "-", idle, unload, str(m["restarts"]))
            for rep in replicas:
                status = m["status"] if m["status"] != "loaded" else rep["status"]
                if rep.get("error") and rep["status"] != "ready":
                    status += f" ({rep['error']})"
                table.add_row(
                    m["model"], (rep["replica"] if rep["pid"] else rep["url"]) + (
                        f" {rep['role']}" if rep.get("role", "both") != "both" else ""), status,
                    str(rep["pid"] or "-"),
                    f"{rep['rss_mib']:.0f} MiB" if rep.get("rss_mib") else "-",
                    str(rep["load"]), f"{rep['kv_usage']:.0%}",
                    "-" if rep["hit_ratio"] is None else f"{rep['hit_ratio']:.0%}",
                    "-" if rep["ttft_p50"] is None else f"{rep['ttft_p50'] * 1000:.0f} ms",
                    idle, unload, str(rep["restarts"]))
        # Piped (scripts, tests): wide enough that no cell is cut to "fail…".
        console = Console(emoji=False) if sys.stdout.isatty() else Console(width=200, emoji=False)
        console.print(table)
        for line in _autoscaled(body["data"]):
            console.print(line, highlight=False, markup=False)
        console.print(f"[dim]{body['waiting_for_load']} request(s) waiting for a load; "
                      f"max loaded: {body['max_loaded'] or 'no limit'}; max memory: "
                      f"{str(body.get('max_memory_mib')) + ' MiB' if body.get('max_memory_mib') else 'no limit'}"
                      "[/dim]", highlight=False)


def logs(
    model: Annotated[str, typer.Argument(help="A model name of the gateway's models.yaml.")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines to show from the end.")] = 50,
    replica: Annotated[int, typer.Option("--replica", "-r", help="Which local replica (0, 1, ...; see justllm ps).", min=0)] = 0,
) -> None:
    """Show a router-mode runner's log (one file per model replica, on this machine)."""
    with cli_errors():
        from justllm.gateway.app import default_log_dir
        from justllm.gateway.runner import log_model, log_name

        if lines < 0:  # (it printed nothing and exited 0)
            raise ValueError(f"--lines must be 0 or more (got {lines})")

        path = default_log_dir() / log_name(model, str(replica))
        if not path.is_file():
            known = sorted(log_model(p) for p in default_log_dir().glob("*.log"))
            which = f"model '{model}'" + (f" replica {replica}" if replica else "")
            raise ValueError(f"no log for {which} in {default_log_dir()} (logs: "
                             f"{', '.join(known) or 'none yet'}; a model's own name, not an "
                             "alias)")
        _print_tail(path, lines)
        if follow:
            _follow(path)


def _print_tail(path: Path, n: int) -> None:
    text = path.read_text(errors="replace").splitlines()
    for line in text[-n:] if n > 0 else []:  # (-n 0: none, then --follow's new ones)
        print(line)


def _follow(path: Path) -> None:
    with path.open(errors="replace") as f:
        f.seek(0, 2)
        try:
            while True:
                line = f.readline()
                if line:
                    print(line, end="", flush=True)
                else:
                    time.sleep(0.25)
        except KeyboardInterrupt:
            return


def _autoscaled(models: list[dict]) -> list[str]:
    """A line per autoscaled model (a line per scaled role of a PD model): its bounds, the
    load each replica is to carry, and the decisions made so far."""
    lines = []
    for m in models:
        scale = m.get("autoscale")
        if not scale:
            continue
        pools = {"": scale} if "min" in scale else {f" ({role})": s for role, s in scale.items()}
        for role, s in pools.items():
            lines.append(f"autoscaler: {m['model']}{role} {s['min']}-{s['max']} replicas, "
                         f"target {s['target_ongoing']:g} ongoing each; {s['up']} up, "
                         f"{s['down']} down so far")
    return lines


def _gateway_listing(r: Any) -> dict | None:
    """The gateway's ``GET /models`` answer, or None for anything else (an OpenAI ``/v1/models``
    list has ``data`` too, but no status per model)."""
    try:
        body = r.json() if r.status_code == 200 else None
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        return None
    if not all(isinstance(m, dict) and {"model", "status", "ttl"} <= m.keys() for m in body["data"]):
        return None
    return body
