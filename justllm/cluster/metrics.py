"""The ingress's ``/metrics``: every replica's own page (its engine's series, already labelled
``model_name``) with a ``replica`` label added, after the cluster's own per-replica gauges.
The gauges take the gateway's names (``justllm_gateway_replica_up``...), so ``justllm top``,
and any dashboard made for router mode, read a cluster the same way. Pure: it renders what
the stats board holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from justllm.gateway.metrics import merge_pages, with_label

Reports = Mapping[str, Mapping[str, Mapping[str, Any]]]  # model -> replica -> report

_PER_REPLICA = (
    ("justllm_gateway_replica_up", "1 while the replica reports a live engine.",
     lambda s: 1 if s.get("healthy") else 0),
    ("justllm_gateway_replica_load", "Running + waiting requests (the routing load).",
     lambda s: s.get("running", 0) + s.get("waiting", 0)),
    ("justllm_gateway_replica_kv_usage", "KV blocks in use, 0-1.", lambda s: s.get("kv_usage")),
    ("justllm_gateway_replica_prefix_cache_hit_ratio", "Prefix-cache hit ratio.",
     lambda s: s.get("hit_ratio")),
    ("justllm_gateway_replica_ttft_p50_seconds", "Median time to first token, last 30 s.",
     lambda s: s.get("ttft_p50")),
)


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def own_series(reports: Reports, models: Sequence[str]) -> str:
    """Per model whether a replica reports in; per replica its state, load, KV use, hit ratio,
    recent TTFT, labelled ``model_name``, ``replica`` and ``node`` (its node's address)."""
    name = "justllm_gateway_model_loaded"
    lines = [f"# HELP {name} 1 while a replica of the model reports in.",
             f"# TYPE {name} gauge"]
    lines += [f"{name}{_labels(model_name=m)} {1 if reports.get(m) else 0}" for m in models]
    for name, doc, value in _PER_REPLICA:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
        for model in models:
            for replica, report in sorted((reports.get(model) or {}).items()):
                v = value(report)
                if v is not None:
                    # replica_up also says the replica's role (prefill, decode, both), as in
                    # router mode: `justllm top` counts a PD model's replicas by it.
                    role = ({"role": str(report["role"])}
                            if name == "justllm_gateway_replica_up" and "role" in report
                            else {})
                    labels = _labels(model_name=model, replica=replica,
                                     node=str(report.get("node_ip", "")), **role)
                    lines.append(f"{name}{labels} {v}")
    return "\n".join(lines) + "\n"


def render(reports: Reports, pages: Mapping[str, Mapping[str, str]],
           models: Sequence[str]) -> bytes:
    """The whole page: the cluster's series, then each replica's ``pages[model][replica]``."""
    labelled = [with_label(page, "replica", replica)
                for model in models for replica, page in sorted((pages.get(model) or {}).items())
                if page]
    return merge_pages([own_series(reports, models), *labelled]).encode()
