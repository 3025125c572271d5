"""Prefix-cache benchmark: requests sharing a ~1,000-token prefix, each with its own question.

Not a test. Against any OpenAI-compatible server (loopback only):

    justllm serve MODEL --port 8080                      # cache on (default)
    justllm serve MODEL --port 8080 --no-prefix-cache    # cache off
    llama-server -m MODEL -np 8 -t 2 -c 8192 --port 8081 # llama.cpp's own prompt cache

    python benchmarks/prefix_cache_bench.py --url http://127.0.0.1:8080 [--cold]

Warm (default): one warm-up request sees the prefix, then ``--requests`` requests run
``--concurrency`` at a time. Cold (``--cold``): a fresh prefix, all requests sent together, and
nothing warmed. Prints TTFT p50/p90 and the total time. Start a fresh server for each run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx


def prefix(tag: str) -> str:
    return f"[{tag}] " + " ".join(
        f"Rule {i}: answer politely and briefly, citing rule {i}." for i in range(80))


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "cache_prompt": True}
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - t0
    return ttft if ttft is not None else float("nan")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()
    shared = prefix("cold" if args.cold else "warm")
    questions = [f"\nQuestion {i}: what is {i} times {i + 3}?\nAnswer:" for i in range(args.requests)]
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        if not args.cold:
            await one(client, args.url, shared + "\nQuestion: warm-up?\nAnswer:", args.max_tokens)
        sem = asyncio.Semaphore(args.requests if args.cold else args.concurrency)

        async def limited(q: str) -> float:
            async with sem:
                return await one(client, args.url, shared + q, args.max_tokens)

        t0 = time.perf_counter()
        ttfts = await asyncio.gather(*[limited(q) for q in questions])
        total = time.perf_counter() - t0
    ttfts.sort()
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
    mode = "cold, all at once" if args.cold else f"warm, concurrency {args.concurrency}"
    print(f"{args.url}  ({mode}, {args.requests} requests)")
    print(f"  TTFT p50 {1000 * statistics.median(ttfts):8.1f} ms   p90 {1000 * p90:8.1f} ms"
          f"   total {total:6.2f} s")


if __name__ == "__main__":
    asyncio.run(main())
