"""Reliability soak: minutes of mixed traffic with random disconnects against one server,
printing its memory, KV use and open file descriptors over time (issue #11).

Not a test (the suite's bounded versions are tests/server/test_reliability.py and
tests/server/test_soak.py). The traffic: justllm/bench/soak.py's completions clients (shared
prefixes, 60% streaming, a share leaving early), plus chat clients (streaming or not, some
leaving mid-answer), an embeddings client, and a client sending bad requests (each must get a
4xx). Loopback only.

    python benchmarks/reliability_soak.py --minutes 15                   # starts `justllm serve`
    python benchmarks/reliability_soak.py --minutes 15 -- --pool-blocks 256

Every ``--every`` seconds it prints the server's RSS, threads, open fds, running requests and
KV blocks in use vs held by the prefix cache; at the end, the request counts and the drift of
RSS and fds from the first sample after warm-up (goal: flat memory, no leaked KV or fds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_soak import start_server  # noqa: E402

from justllm.bench.soak import SoakConfig, classify, idle_leak, metric, post, soak  # noqa: E402

BAD_BODIES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}),
    ("/v1/completions", {"prompt": [10**9]}),
    ("/v1/completions", {"prompt": "hi", "unknown_field": 1}),
    ("/v1/embeddings", {"input": []}),
]


def proc_stats(pid: int) -> dict[str, int]:
    """RSS (KiB), threads and open file descriptors of a local process, from /proc."""
    stats = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            stats[key] = int(value.split()[0])
    stats["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return stats


async def chat_client(idx: int, url: str, deadline: float, disconnect: float, counts: Counter,
                      seed: int) -> None:
    rng = random.Random(seed * 7919 + idx)
    questions = ["What is the capital of France?", "Name three colours.", "What is 2+2?",
                 "Write one sentence about the sea.", "Who wrote Hamlet?"]
    async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
        while time.monotonic() < deadline:
            body = {"messages": [{"role": "user", "content": rng.choice(questions)}],
                    "max_tokens": rng.choice([8, 32, 96]), "temperature": rng.choice([0, 0.7]),
                    "stream": rng.random() < 0.5}
            counts["chat"] += 1
            leave = rng.random() < disconnect
            try:
                if body["stream"]:
                    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                        n = 0
                        async for line in r.aiter_lines():
                            n += line.startswith("data: {")
                            if leave and n >= rng.randint(1, 5):
                                counts["chat_disconnected"] += 1
                                break
                        else:
                            counts["chat_" + classify(r.status_code)] += 1
                else:
                    counts["chat_" + await post(http, url + "/v1/chat/completions", body,
                                                rng.uniform(0.05, 1.5) if leave else None)] += 1
            except httpx.HTTPError as e:
                counts["transport_error"] += 1
                print(f"chat {idx}: {type(e).__name__}: {e}", file=sys.stderr)


async def side_client(url: str, deadline: float, counts: Counter) -> None:
    """Embeddings and bad requests, one after another."""
    rng = random.Random(5)
    async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
        while time.monotonic() < deadline:
            if rng.random() < 0.5:
                r = await http.post(url + "/v1/embeddings",
                                    json={"input": [f"soak text {rng.randint(0, 99)}"]})
                counts["embeddings_" + classify(r.status_code)] += 1
            else:
                path, body = rng.choice(BAD_BODIES)
                r = await http.post(url + path, json=body)
                counts["bad_" + ("4xx" if 400 <= r.status_code < 500 else str(r.status_code))] += 1
            await asyncio.sleep(0.2)


async def monitor(url: str, pid: int | None, deadline: float, every: float,
                  rows: list[dict]) -> None:
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        while time.monotonic() < deadline:
            text = (await http.get(url + "/metrics")).text
            row = {"t": time.monotonic() - t0,
                   "running": metric(text, "vllm:num_requests_running"),
                   "kv_used": metric(text, "justllm_kv_blocks_used"),
                   "cached": metric(text, "justllm_prefix_cache_blocks")}
            if pid is not None:
                row.update(proc_stats(pid))
            rows.append(row)
            print(f"{row['t'] / 60:6.1f} min  RSS {row.get('VmRSS', 0) / 1024:7.1f} MiB  "
                  f"threads {row.get('Threads', '-'):>3}  fds {row.get('fds', '-'):>4}  "
                  f"running {row['running']:3.0f}  KV used {row['kv_used']:5.0f} "
                  f"(prefix cache {row['cached']:5.0f})", flush=True)
            await asyncio.sleep(every)


async def run(url: str, pid: int | None, args) -> tuple[Counter, list[dict]]:
    seconds = args.minutes * 60
    deadline = time.monotonic() + seconds
    cfg = SoakConfig(clients=args.clients, seconds=seconds, disconnect=args.disconnect,
                     seed=args.seed)
    chat_counts: Counter = Counter()
    rows: list[dict] = []
    results = await asyncio.gather(
        soak(url, cfg),
        *(chat_client(i, url, deadline, args.disconnect, chat_counts, args.seed)
          for i in range(args.chat_clients)),
        side_client(url, deadline, chat_counts),
        monitor(url, pid, deadline, args.every, rows))
    return results[0] + chat_counts, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running server (else one is started)")
    ap.add_argument("--pid", type=int, help="the running server's pid, for RSS and fds")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=4, help="completions clients")
    ap.add_argument("--chat-clients", type=int, default=2)
    ap.add_argument("--disconnect", type=float, default=0.25,
                    help="share of requests whose client leaves early")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_args", nargs="*", help="flags for `justllm serve` (after --)")
    args = ap.parse_args()
    proc, url, pid = None, args.url, args.pid
    log = tempfile.NamedTemporaryFile("w+b", prefix="soak-server-", suffix=".log", delete=False)
    if url is None:
        proc, url = start_server(args.serve_args, log)
        pid = proc.pid
    try:
        counts, rows = asyncio.run(run(url, pid, args))
        used, cached = asyncio.run(idle_leak(url))
        idle = proc_stats(pid) if pid is not None else {}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"\n{args.minutes:g} min, {args.clients} completions + {args.chat_clients} chat "
          f"clients + embeddings/bad requests; serve flags: "
          f"{' '.join(args.serve_args) or '(defaults)'}")
    print("counts:", dict(sorted(counts.items())))
    if pid is not None and len(rows) > 2:
        first = rows[1]  # after one interval of warm-up (model pages, first allocations)
        last = rows[-1]
        print(f"RSS {first['VmRSS'] / 1024:.1f} -> {last['VmRSS'] / 1024:.1f} MiB "
              f"(max {max(r['VmRSS'] for r in rows) / 1024:.1f}); fds {first['fds']} -> "
              f"{last['fds']} (idle {idle.get('fds')}); threads {first['Threads']} -> "
              f"{last['Threads']}")
    print(f"idle: {used:.0f} KV blocks in use, {cached:.0f} held by the prefix cache, "
          f"leak {used - cached:.0f}")
    if proc is not None:
        print("server exit code:", proc.returncode, "| log:", log.name)


if __name__ == "__main__":
    main()
