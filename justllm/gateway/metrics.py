"""The gateway's ``/metrics``: its own series (loads, unloads, restarts, load time, requests
waiting for a load, which models are loaded; per replica its state, load, KV use, hit ratio
and recent TTFT; routing decisions by reason; the autoscaler's) followed by every replica's
page. Replica series already carry ``model_name`` (each runner serves under its model's name);
the gateway adds ``replica``, and families that several replicas report are merged so each
HELP/TYPE appears once."""

from __future__ import annotations

import asyncio
import re

import httpx

from justllm.gateway.replica import Replica
from justllm.gateway.routing import REASONS, Router
from justllm.gateway.supervisor import ModelState, Supervisor

REPLICA_UP = "justllm_gateway_replica_up"
_SAMPLE = re.compile(r"^([^\s{]+)(\{.*\})?(\s.*)$")


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


def label_value(value: object) -> str:
    """``value`` as a Prometheus label value: text, with ``\\``, ``"`` and newlines escaped
    as the exposition format requires (a plugin's reason may hold any of them)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def with_label(page: str, name: str, value: str) -> str:
    """Every sample of a Prometheus text page with one more label (``replica="1"``)."""
    label = f'{name}="{label_value(value)}"'
    out = []
    for line in page.splitlines():
        m = _SAMPLE.match(line) if line and not line.startswith("#") else None
        if m is not None:
            metric, labels, rest = m.groups()
            labels = (labels[:-1] + "," + label + "}" if labels and labels != "{}"
                      else "{" + label + "}")
            line = metric + labels + rest
        out.append(line)
    return "\n".join(out) + "\n"


def _labels(s: ModelState, **more: object) -> str:
    return "{" + ",".join([f'model_name="{label_value(s.spec.name)}"',
                           *(f'{k}="{label_value(v)}"' for k, v in more.items())]) + "}"


def _decisions(s: ModelState) -> list[tuple[dict[str, str], str, int]]:
    """A model's routing decisions: (labels, reason, count), a PD model's by ``role`` (its
    prefill router places prompts by the model's policy, its decode router by load: only the
    decode router's were counted)."""
    if not s.spec.pd:
        return [({}, reason, n) for reason, n in _by_reason(s.router)]
    return [({"role": role}, reason, n)
            for role, router in (("prefill", s.prefill_router), ("decode", s.router))
            for reason, n in _by_reason(router)]


def _by_reason(router: Router) -> list[tuple[str, int]]:
    """A router's decisions by reason: every built-in reason (zeros too), then a plugin
    policy's own, as text (reasons of mixed types used to fail the sort, and /metrics)."""
    counts: dict[str, int] = dict.fromkeys(REASONS, 0)
    own: dict[str, int] = {}
    for reason, n in router.counts.items():
        key = str(reason)
        if key in counts:
            counts[key] += n
        else:
            own[key] = own.get(key, 0) + n
    return [*counts.items(), *sorted(own.items())]


def _role(name: str, replica: Replica) -> dict[str, str]:
    """The ``role`` label (prefill, decode, both), on the replica_up series only."""
    return {"role": replica.role} if name == REPLICA_UP else {}


def _replicas(sup: Supervisor) -> list[str]:
    """Per replica: in rotation, load, KV use, hit ratio, TTFT; routing decisions by reason;
    the autoscaler's count, target and decisions."""
    lines: list[str] = []
    per_replica = [
        (REPLICA_UP, "1 while the replica is in the rotation (label role: prefill, decode "
         "or both).",
         lambda r: 1 if r.routable else 0),
        ("justllm_gateway_replica_in_flight", "Requests the gateway has on the replica.",
         lambda r: r.in_flight),
        ("justllm_gateway_replica_load", "Running + waiting requests (the routing load).",
         lambda r: r.load_total),
        ("justllm_gateway_replica_kv_usage", "KV blocks in use, 0-1, at the last poll.",
         lambda r: r.kv_usage),
        ("justllm_gateway_replica_prefix_cache_hit_ratio",
         "Prefix-cache hit ratio at the last poll.", lambda r: r.hit_ratio),
        ("justllm_gateway_replica_ttft_p50_seconds",
         "Median time to first token over the last 30 s.", lambda r: r.ttft_p50)]
    for name, doc, value in per_replica:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
        lines += [f"{name}{_labels(s, replica=r.id, **_role(name, r))} {value(r)}"
                  for s in sup.models.values() for r in s.replicas if value(r) is not None]
    name = "justllm_gateway_replica_restarts_total"
    lines += [f"# HELP {name} Times the replica's runner was restarted after dying.",
              f"# TYPE {name} counter"]
    lines += [f"{name}{_labels(s, replica=r.id)} {s.replica_restarts[r.id]}"
              for s in sup.models.values() for r in s.replicas]
    name = "justllm_gateway_routing_decisions_total"
    lines += [f"# HELP {name} Requests routed to a replica, by the reason it was chosen.",
              f"# TYPE {name} counter"]
    lines += [f"{name}{_labels(s, **role, reason=reason)} {n}"
              for s in sup.models.values() if len(s.spec.urls) + s.spec.replicas > 1 or
              bool(s.spec.scaled_pools)  # a plugin policy's own reasons too
              for role, reason, n in _decisions(s)]
    pd = [s for s in sup.models.values() if s.spec.pd]
    for name, kind, doc, value in [
            ("justllm_gateway_pd_transfers_total", "counter",
             "Prompts a prefill replica computed and handed over.", lambda s: s.pd_transfers),
            ("justllm_gateway_pd_bytes_total", "counter", "KV bytes handed over.",
             lambda s: s.pd_bytes),
            ("justllm_gateway_pd_prefill_seconds_sum", "counter",
             "Seconds from sending a prompt to a prefill replica to its KV's last byte "
             "relayed to the decode replica.", lambda s: round(s.pd_seconds, 6)),
            ("justllm_gateway_pd_short_prompts_total", "counter",
             "Prompts under prefill-min-tokens, computed on a decode replica.",
             lambda s: s.pd_short_prompts),
            ("justllm_gateway_pd_aborted_total", "counter",
             "Requests whose client left while a prefill replica computed the prompt.",
             lambda s: s.pd_aborted)]:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{_labels(s)} {value(s)}" for s in pd]
    name = "justllm_gateway_pd_fallbacks_total"
    lines += [f"# HELP {name} Requests of a PD model served whole by a decode replica, by "
              "reason.", f"# TYPE {name} counter"]
    lines += [f"{name}{_labels(s, reason=r)} {n}" for s in pd for r, n in
              sorted(s.pd_fallbacks.items())]
    # One series per autoscaled pool: a model's local replicas, or a PD model's prefill and
    # decode replicas apart (label role).
    pools = [(s, pool, config, {} if pool == "both" else {"role": pool})
             for s in sup.models.values() for pool, config in s.spec.scaled_pools]

    gauges = [("justllm_autoscaler_replicas", "Local replicas serving or starting.",
               lambda s, pool, c: len(s.scaling(pool))),
              ("justllm_autoscaler_min_replicas", "The autoscaler's lower bound.",
               lambda s, pool, c: c.min_replicas),
              ("justllm_autoscaler_max_replicas", "The autoscaler's upper bound.",
               lambda s, pool, c: c.max_replicas),
              # (what the autoscaler decides on: it counted the retired replicas' requests
              # too, and their last polls' for ever)
              ("justllm_autoscaler_ongoing_requests",
               "Running + waiting over the replicas serving or starting (as the autoscaler "
               "counts them).", lambda s, pool, c: sum(r.load_total for r in s.scaling(pool)))]
    for name, doc, of_pool in gauges:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
        lines += [f"{name}{_labels(s, **role)} {of_pool(s, pool, c)}"
                  for s, pool, c, role in pools]
    name = "justllm_autoscaler_decisions_total"
    lines += [f"# HELP {name} Scaling decisions, by direction.", f"# TYPE {name} counter"]
    lines += [f"{name}{_labels(s, **role, direction=d)} {s.scaled[pool, d]}"
              for s, pool, _, role in pools for d in ("up", "down")]
    return lines


def _own(sup: Supervisor) -> str:
    lines = ["# HELP justllm_gateway_requests_waiting_for_load Requests waiting for a model to load.",
             "# TYPE justllm_gateway_requests_waiting_for_load gauge",
             f"justllm_gateway_requests_waiting_for_load {sup.waiting}"]
    per_model = [
        ("justllm_gateway_model_loaded", "gauge", "1 while the model's runner is up.",
         lambda s: 1 if s.status == "loaded" else 0),
        ("justllm_gateway_model_loads_total", "counter", "Runners started and ready.",
         lambda s: s.loads),
        ("justllm_gateway_model_restarts_total", "counter", "Runners restarted after dying.",
         lambda s: s.restarts),
        ("justllm_gateway_model_unloads_total", "counter",
         "Runners stopped (idle, room, request, scaled down).", lambda s: s.unloads),
    ]
    for name, kind, doc, value in per_model:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{_labels(s)} {value(s)}" for s in sup.models.values()]
    name = "justllm_gateway_model_load_seconds"
    lines += [f"# HELP {name} Seconds from starting a runner to its first 200 on /health.",
              f"# TYPE {name} summary"]
    for s in sup.models.values():
        lines += [f"{name}_sum{_labels(s)} {sum(s.load_seconds):.3f}",
                  f"{name}_count{_labels(s)} {len(s.load_seconds)}"]
    return "\n".join(lines + _replicas(sup)) + "\n"


async def render_metrics(sup: Supervisor, http: httpx.AsyncClient) -> bytes:
    replicas = [r for s in sup.models.values() if s.status == "loaded" for r in s.replicas
                if r.routable]

    async def page(url: str | None, replica: str) -> str:
        try:
            return with_label((await http.get(f"{url}/metrics", timeout=2)).text,
                              "replica", replica)
        except httpx.HTTPError:
            return ""

    pages = await asyncio.gather(*(page(r.url, r.id) for r in replicas))
    return merge_pages([_own(sup), *pages]).encode()
