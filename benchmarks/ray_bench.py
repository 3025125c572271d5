"""What running on Ray Serve costs and what justllm's router buys there (issue #15's benchmark).
Not a test. One machine: a private local Ray head, started and stopped here.

    python benchmarks/ray_bench.py                       # both parts
    python benchmarks/ray_bench.py --parts routing --pool-blocks 192 --json out.json

Part "overhead": the same model, one replica, --concurrency streams: `justllm bench` (random
prompts, greedy, --output-len tokens) straight to `justllm serve`, --rounds rounds, before any
Ray process runs; then the same rounds (same seeds) through the Ray ingress (HTTP proxy ->
ingress replica -> model replica). Both engines run with the same flags. Not interleaved: with
a Ray head up, even idle, a 2-thread llama.cpp on 2 cores loses most of its speed to Ray's
background processes (its threads meet at barriers), which would charge Ray's cost to the
direct side. Prints the medians of output tok/s, TTFT p50 and ITL p50 and their ratio (the
goal: Ray's tok/s within 10%).

Part "routing": 2 replicas (--threads each), the shared-prefix workload of
benchmarks/routing_bench.py (its prefixes, questions, order and client), once with justllm's
RequestRouter (cache-aware) and once with Ray's default router (power of two choices), each on
a fresh app (empty caches). Prints the prefix-cache hit ratios (prompt tokens, requests; and
both leaving out each prefix's first request) from the ingress's /metrics, and the client's
TTFT p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import bench  # noqa: E402  (the other benchmarks' helpers)
from prefix_soak import start_server  # noqa: E402
from routing_bench import (  # noqa: E402
    COUNTERS,
    count_tokens,
    make_prefix,
    make_requests,
    snapshot,
    workload,
)

from justllm.cli.options import ENGINE_FLAGS, engine_config  # noqa: E402
from justllm.gateway.config import Flags, load_config  # noqa: E402
from justllm.gateway.runner import free_port  # noqa: E402
from justllm.models.source import resolve_model  # noqa: E402

MODEL = "demo"  # routing_bench's model name


def cluster_module():
    """Ray's modules, imported once the private temp dir is set."""
    from justllm.cluster import deploy, local_ray
    from justllm.cluster.router import JustLLMRouter

    return deploy, local_ray, JustLLMRouter


def deploy_app(cl, cluster, settings, entry: dict, router) -> str:
    flags = Flags(frozenset(f.name.replace("_", "-") for f in ENGINE_FLAGS))
    config = load_config({"models": {MODEL: entry}}, flags)
    t0 = time.perf_counter()
    cl.deploy(config, settings, engine_config, cluster, request_router=router)
    print(f"  deployed in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return f"http://{settings.host}:{settings.port}"


def delete_app(cl, cluster, app: str) -> None:
    from ray import serve

    with cl.connected(cluster):
        serve.delete(app)


def overhead_flags(args) -> dict:
    return {"threads": args.overhead_threads, "max-seqs": args.concurrency}


def rounds(url: str, args, side: str) -> list[dict]:
    httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
               timeout=300)  # first-request costs out of the rounds
    out = []
    for i in range(args.rounds):
        out.append(bench(url, MODEL, args, seed=100 + i))
        r = out[-1]
        print(f"  {side} round {i + 1}/{args.rounds}: {r['output_throughput']:.1f} tok/s, "
              f"TTFT p50 {r['median_ttft_ms']:.0f} ms, ITL p50 {r['median_itl_ms']:.1f} ms",
              file=sys.stderr, flush=True)
    return out


def direct_rounds(args) -> list[dict]:
    """`justllm serve` alone, no Ray process on the machine."""
    log = tempfile.NamedTemporaryFile("w+b", prefix="ray-bench-serve-", suffix=".log",
                                      delete=False)
    flags = overhead_flags(args)
    proc, url = start_server([args.model, "--served-model-name", MODEL,
                              *(x for k, v in flags.items() for x in (f"--{k}", str(v)))], log)
    try:
        return rounds(url, args, "direct")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def ray_rounds(args, cl, cluster, settings) -> list[dict]:
    url = deploy_app(cl, cluster, settings, {"source": args.model, "replicas": 1,
                                             **overhead_flags(args)}, args.router_class)
    try:
        return rounds(url, args, "ray")
    finally:
        delete_app(cl, cluster, settings.app)


def medians(rows: dict[str, list[dict]]) -> dict:
    return {key: {side: statistics.median(r[key] for r in runs) for side, runs in rows.items()}
            for key in ("output_throughput", "median_ttft_ms", "median_itl_ms")}


def routing(args, cl, cluster, settings) -> list[dict]:
    n_tokens = count_tokens(args.model)
    prefixes = [make_prefix(p, args.prefix_tokens, n_tokens) for p in range(args.prefixes)]
    requests = make_requests(args, prefixes)
    entry = {"source": args.model, "replicas": 2, "threads": args.threads,
             "max-seqs": args.max_seqs or args.concurrency}
    if args.pool_blocks:
        entry["pool-blocks"] = args.pool_blocks
    runs = []
    for name, router in (("cache-aware", args.router_class), ("ray-pow2", None)):
        print(f"routing: {name} ...", file=sys.stderr, flush=True)
        url = deploy_app(cl, cluster, settings, entry, router)
        time.sleep(3)  # both replicas on the stats board
        before = snapshot(url)
        results, wall = asyncio.run(workload(url, requests, args))
        time.sleep(2.5)  # the board's pages are a report period old
        after = snapshot(url)
        delete_app(cl, cluster, settings.app)
        delta = {rep: {k: after[rep][k] - before.get(rep, {}).get(k, 0.0) for k in COUNTERS}
                 for rep in after}
        tot = {k: sum(d[k] for d in delta.values()) for k in COUNTERS}
        firsts: dict[int, int] = {}
        for i, (p, _, _) in enumerate(requests):
            firsts.setdefault(p, i)
        by_index = {(r["prefix"], r["question"]): r for r in results}
        first_tokens = sum(by_index[requests[i][:2]]["prompt_tokens"] or 0
                           for i in firsts.values())
        n_req = tot["hits"] + tot["misses"]
        ttfts = [r["ttft"] for r in results]
        runs.append({
            "router": name, "requests": len(results), "wall_s": round(wall, 2),
            "token_hit_ratio": tot["hit_tokens"] / tot["queried"] if tot["queried"] else None,
            "request_hit_ratio": tot["hits"] / n_req if n_req else None,
            "token_hit_ratio_after_first": (tot["hit_tokens"] / (tot["queried"] - first_tokens)
                                            if tot["queried"] > first_tokens else None),
            "request_hit_ratio_after_first": (tot["hits"] / (n_req - len(firsts))
                                              if n_req > len(firsts) else None),
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "spread": {p: dict(Counter(r["replica"] for r in results if r["prefix"] == p))
                       for p in range(args.prefixes)}})
    return runs


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the demo model)")
    ap.add_argument("--parts", default="overhead,routing")
    ap.add_argument("--rounds", type=int, default=3, help="overhead: rounds per side")
    ap.add_argument("--num-requests", type=int, default=32, help="overhead: per round")
    ap.add_argument("--output-len", type=int, default=64, help="overhead: tokens per request")
    ap.add_argument("--overhead-threads", type=int, default=2, help="overhead: the replica's")
    ap.add_argument("--concurrency", type=int, default=8, help="streams (both parts)")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8, help="routing: tokens per request")
    ap.add_argument("--threads", type=int, default=1, help="routing: per replica")
    ap.add_argument("--max-seqs", type=int, default=0, help="routing: per replica")
    ap.add_argument("--pool-blocks", type=int, default=0, help="routing: per replica")
    ap.add_argument("--order", choices=["interleaved", "shuffled"], default="shuffled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.model = resolve_model(args.model)
    parts = {p.strip() for p in args.parts.split(",")}
    # A private Ray: its temp dir and justllm's record of the head are this run's own.
    workdir = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))
    os.environ["RAY_TMPDIR"] = str(workdir / "ray")
    os.environ["JUSTLLM_CACHE_DIR"] = str(workdir / "cache")
    os.environ.pop("RAY_ADDRESS", None)
    results: dict = {}
    direct = direct_rounds(args) if "overhead" in parts else []
    cl, local_ray, args.router_class = cluster_module()
    from justllm.cluster.options import ClusterSettings

    settings = ClusterSettings(port=free_port())
    t0 = time.perf_counter()
    cluster = cl.start_local()
    print(f"local Ray head up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    try:
        if "overhead" in parts:
            results["overhead"] = medians({"direct": direct, "ray": ray_rounds(
                args, cl, cluster, settings)})
        if "routing" in parts:
            results["routing"] = routing(args, cl, cluster, settings)
    finally:
        try:
            from ray import serve

            with cl.connected(cluster):
                serve.shutdown()
        finally:
            local_ray.stop_head(cluster.local)
    if "overhead" in results:
        o = results["overhead"]
        print(f"overhead: {args.rounds} rounds x {args.num_requests} requests, "
              f"{args.concurrency} streams, {args.output_len} tokens, one replica "
              f"({args.overhead_threads} threads)")
        for key, label in (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
                           ("median_itl_ms", "ITL p50 ms")):
            a, b = o[key]["direct"], o[key]["ray"]
            print(f"  {label:14} direct {a:9.2f}   ray {b:9.2f}   ray/direct {b / a:.3f}")
    if "routing" in results:
        print(f"routing: {args.prefixes} prefixes x {args.questions} questions, 2 replicas "
              f"({args.threads} thread each), {args.concurrency} concurrent, order {args.order}, "
              f"pool blocks {args.pool_blocks or 'default'}")
        print(f"  {'router':12} {'tok hit':>8} {'req hit':>8} {'tok hit*':>9} {'req hit*':>9} "
              f"{'TTFT p50':>9} {'wall s':>7}")
        for r in results["routing"]:
            print(f"  {r['router']:12} {fmt(r['token_hit_ratio']):>8} "
                  f"{fmt(r['request_hit_ratio']):>8} {fmt(r['token_hit_ratio_after_first']):>9} "
                  f"{fmt(r['request_hit_ratio_after_first']):>9} {r['ttft_p50_ms']:8.0f}ms "
                  f"{r['wall_s']:7.1f}")
            print(f"    spread per prefix: {r['spread']}")
        print("  (* leaving out each prefix's first request)")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "router_class")}
        Path(args.json).write_text(json.dumps({"config": config, **results}, indent=2))


if __name__ == "__main__":
    main()
