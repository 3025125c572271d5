"""Aggregate streaming output tok/s of OpenAI-compatible servers under N concurrent clients.

A benchmark, not a test: nothing is asserted, it prints numbers. Each request is a streaming
POST {url}/v1/chat/completions (temperature 0, ignore_eos, stream_options.include_usage) with
a distinct short prompt; `--concurrency` requests are kept in flight until `--num-requests`
have finished. Reported per server: wall time, aggregate output tok/s, requests/s, TTFT
p50/p90 (time to the first content delta) and mean inter-token latency. With --url2 the same
workload runs against the second server afterwards and both are printed side by side.

Start both servers on the same model with the same parallelism (the runs are sequential, so
an idle server should not steal cores from the measured one; check with top if unsure):

    llama-server -m MODEL -np 8 -t 2 -c 8192 --port 8081       # llama.cpp's own server
    justllm serve MODEL --port 8080 --max-seqs 8                 # ours

    .venv/bin/python benchmarks/serve_compare.py --url http://127.0.0.1:8080 \\
        --url2 http://127.0.0.1:8081 --concurrency 8 --num-requests 32 --max-tokens 128

`-np 8 -c 8192` gives llama-server 8 slots of 1024 tokens each. Pass --model NAME if the
server checks the model field (it is omitted otherwise). Prompts are the same on every run,
so restart a server between runs: both reuse cached prompt prefixes, which lowers TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

TOPICS = ["the sea", "a lighthouse keeper", "a lost robot", "the first snow",
          "a dragon's library", "a night train", "an old clockmaker", "a city on Mars",
          "a stubborn cat", "a desert well", "a forgotten violin", "the last bookshop",
          "a talking river", "a winter market", "a broken compass", "a garden in space"]


@dataclass
class Result:
    ttft: float = 0.0  # seconds from sending the request to the first content delta
    latency: float = 0.0  # seconds from sending the request to the end of the stream
    tokens: int = 0  # completion tokens: usage.completion_tokens, else content chunks
    chunks: int = 0  # content deltas received
    usage_seen: bool = False
    decode_span: float = 0.0  # first content delta -> last content delta


@dataclass
class Run:
    url: str
    wall: float
    results: list[Result] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def prompt(i: int) -> str:
    return f"Write a story about {TOPICS[i % len(TOPICS)]} (story #{i})."


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def one_request(client: httpx.AsyncClient, url: str, i: int,
                      args: argparse.Namespace) -> Result:
    body: dict[str, object] = {
        "messages": [{"role": "user", "content": prompt(i)}],
        "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": True,
    }
    if args.model:
        body["model"] = args.model
    res = Result()
    t0 = time.perf_counter()
    first = last = 0.0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if isinstance(chunk.get("usage"), dict) and "completion_tokens" in chunk["usage"]:
                res.tokens = int(chunk["usage"]["completion_tokens"])
                res.usage_seen = True
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    last = time.perf_counter()
                    if not res.chunks:
                        first = last
                    res.chunks += 1
    res.latency = time.perf_counter() - t0
    res.ttft = first - t0 if res.chunks else res.latency
    res.decode_span = last - first
    if not res.usage_seen:
        res.tokens = res.chunks
    return res


async def run_workload(url: str, args: argparse.Namespace) -> Run:
    n = args.concurrency + 1
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    # trust_env=False: never route loopback traffic through a proxy from the environment.
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        for w in range(args.warmup):  # not measured: first requests pay for graph/buffer setup
            await one_request(client, url, 10_000 + w, args)
        run = Run(url=url, wall=0.0)
        next_i = 0

        async def worker() -> None:
            nonlocal next_i
            while next_i < args.num_requests:
                i, next_i = next_i, next_i + 1
                try:
                    run.results.append(await one_request(client, url, i, args))
                except Exception as e:  # noqa: BLE001 - report and keep the other clients going
                    run.errors.append(f"request {i}: {type(e).__name__}: {e}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        run.wall = time.perf_counter() - t0
    return run


def summarize(run: Run) -> dict[str, float]:
    rs = run.results
    toks = sum(r.tokens for r in rs)
    itls = [r.decode_span / (r.tokens - 1) for r in rs if r.tokens > 1 and r.chunks > 1]
    return {
        "requests ok": float(len(rs)), "errors": float(len(run.errors)),
        "output tokens": float(toks), "wall time s": run.wall,
        "output tok/s": toks / run.wall if run.wall else 0.0,
        "requests/s": len(rs) / run.wall if run.wall else 0.0,
        "TTFT p50 ms": 1000 * percentile([r.ttft for r in rs], 0.5),
        "TTFT p90 ms": 1000 * percentile([r.ttft for r in rs], 0.9),
        "mean ITL ms": 1000 * sum(itls) / len(itls) if itls else float("nan"),
        "latency p50 s": percentile([r.latency for r in rs], 0.5),
    }


def warn(run: Run, max_tokens: int) -> None:
    for e in run.errors[:5]:
        print(f"ERROR {run.url}: {e}")
    if not run.results:
        return
    if not all(r.usage_seen for r in run.results):
        print(f"NOTE {run.url}: no usage chunk on some responses; counted content deltas instead")
    short = [r.tokens for r in run.results if r.tokens < max_tokens]
    if short:
        print(f"WARNING {run.url}: {len(short)}/{len(run.results)} requests returned fewer than "
              f"{max_tokens} tokens (min {min(short)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    ap.add_argument("--url2", help="second server; same workload, run afterwards")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", help="model field to send (omitted if not given)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each run")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout, s")
    args = ap.parse_args()

    urls = [u.rstrip("/") for u in (args.url, args.url2) if u]
    print(f"workload: {args.num_requests} requests, concurrency {args.concurrency}, "
          f"max_tokens {args.max_tokens}, warm-up {args.warmup}")
    runs: list[Run] = []
    for u in urls:
        print(f"running against {u} ...", flush=True)
        runs.append(asyncio.run(run_workload(u, args)))
    for run in runs:
        warn(run, args.max_tokens)
    stats = [summarize(r) for r in runs]
    w = max(24, *(len(u) + 2 for u in urls))
    print(f"{'':<16}" + "".join(f"{u:>{w}}" for u in urls))
    for key in stats[0]:
        digits = 0 if key in ("requests ok", "errors", "output tokens") else 2
        print(f"{key:<16}" + "".join(f"{s[key]:>{w}.{digits}f}" for s in stats))
    if len(stats) == 2:
        b = stats[1]["output tok/s"]
        print(f"output tok/s ratio url/url2: {stats[0]['output tok/s'] / b:.3f}" if b else
              "output tok/s ratio url/url2: n/a (url2 produced nothing)")


if __name__ == "__main__":
    main()
