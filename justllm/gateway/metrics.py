"""The gateway's ``/metrics``: its own series (loads, unloads, restarts, load time, requests
waiting for a load, which models are loaded) followed by every loaded runner's page. Runner
series already carry ``model_name`` (each runner serves under its model's name); families that
several runners report are merged so each HELP/TYPE appears once."""

from __future__ import annotations

import asyncio

import httpx

from justllm.gateway.supervisor import Supervisor


def merge_pages(pages: list[str]) -> str:
    """Prometheus text pages as one: each family's HELP and TYPE once, then all its samples."""
    order: list[str] = []
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for page in pages:
        family = ""
        for line in page.splitlines():
            if not line.strip():
                continue
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    if family not in heads:
                        order.append(family)
                        heads[family], samples[family] = [], []
                    if len(heads[family]) < 2 and line not in heads[family]:
                        heads[family].append(line)
                continue
            samples.setdefault(family, []).append(line)
            if family not in heads:
                order.append(family)
                heads[family] = []
    return "".join("\n".join(heads[f] + samples.get(f, [])) + "\n" for f in order)


def _own(sup: Supervisor) -> str:
    lines = ["# HELP justllm_gateway_requests_waiting_for_load Requests waiting for a model to load.",
             "# TYPE justllm_gateway_requests_waiting_for_load gauge",
             f"justllm_gateway_requests_waiting_for_load {sup.waiting}",
             "# HELP justllm_gateway_model_unloads_total Runners stopped (idle, room, request).",
             "# TYPE justllm_gateway_model_unloads_total counter",
             f"justllm_gateway_model_unloads_total {sup.unloads}"]
    per_model = [
        ("justllm_gateway_model_loaded", "gauge", "1 while the model's runner is up.",
         lambda s: 1 if s.status == "loaded" else 0),
        ("justllm_gateway_model_loads_total", "counter", "Runners started and ready.",
         lambda s: s.loads),
        ("justllm_gateway_model_restarts_total", "counter", "Runners restarted after dying.",
         lambda s: s.restarts),
    ]
    for name, kind, doc, value in per_model:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{model_name="{s.spec.name}"}} {value(s)}'
                  for s in sup.models.values()]
    name = "justllm_gateway_model_load_seconds"
    lines += [f"# HELP {name} Seconds from starting a runner to its first 200 on /health.",
              f"# TYPE {name} summary"]
    for s in sup.models.values():
        lines += [f'{name}_sum{{model_name="{s.spec.name}"}} {sum(s.load_seconds):.3f}',
                  f'{name}_count{{model_name="{s.spec.name}"}} {len(s.load_seconds)}']
    return "\n".join(lines) + "\n"


async def render_metrics(sup: Supervisor, http: httpx.AsyncClient) -> bytes:
    runners = [s.runner for s in sup.models.values()
               if s.status == "loaded" and s.runner is not None]

    async def page(url: str) -> str:
        try:
            return (await http.get(url + "/metrics", timeout=2)).text
        except httpx.HTTPError:
            return ""

    pages = await asyncio.gather(*(page(r.url) for r in runners))
    return merge_pages([_own(sup), *pages]).encode()
