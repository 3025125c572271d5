"""The prefix-cache soak workload (issue #21): a busy user's concurrent completions traffic.

Each client sends ``/v1/completions`` requests one after another: prompts of 50, 200 or 500 words
drawn from a 20-word vocabulary (so most prompts share their first one or two tokens and little
more) ending in a short unique question; ``max_tokens`` 4, 16 or 48; temperature 0 or 0.8; 60%
streaming; a share of clients leave early, mid-prefill or mid-stream. Used by
``benchmarks/prefix_soak.py`` (minutes of it) and tests/server/test_soak.py (a bounded run).
Loopback servers only.
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass

import httpx

WORDS = ("apple river stone light music green window cloud paper silver "
         "garden winter orange bridge forest candle mirror ocean thunder velvet").split()


@dataclass(frozen=True)
class SoakConfig:
    clients: int = 6
    seconds: float = 180.0
    requests_per_client: int | None = None  # stop after this many as well
    disconnect: float = 0.2  # share of requests whose client leaves early
    lengths: tuple[int, ...] = (50, 200, 500)  # prompt words
    max_tokens: tuple[int, ...] = (4, 16, 48)
    seed: int = 0


def prompt(rng: random.Random, n: int, lengths: tuple[int, ...]) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(rng.choice(lengths)))
    return f"{body}\nQuestion {n}: which word comes next?"


async def client(idx: int, url: str, cfg: SoakConfig, deadline: float, counts: Counter) -> None:
    rng = random.Random(cfg.seed * 1000 + idx)
    n = 0
    async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
        while time.monotonic() < deadline and n != cfg.requests_per_client:
            n += 1
            body = {"prompt": prompt(rng, idx * 100000 + n, cfg.lengths),
                    "max_tokens": rng.choice(cfg.max_tokens),
                    "temperature": rng.choice((0.0, 0.8)), "stream": rng.random() < 0.6}
            leave = rng.random() < cfg.disconnect
            counts["requests"] += 1
            try:
                if body["stream"]:
                    await stream(http, url, body, rng.randint(0, 6) if leave else None, counts)
                else:
                    counts[await post(http, url + "/v1/completions", body,
                                      rng.uniform(0.05, 2.0) if leave else None)] += 1
            except httpx.HTTPError as e:
                counts["transport_error"] += 1
                print(f"client {idx}: {type(e).__name__}: {e}", file=sys.stderr)


async def post(http: httpx.AsyncClient, url: str, body: dict, leave_after: float | None
               ) -> str:
    """A non-streaming request whose client leaves after ``leave_after`` seconds (None: it
    waits): "ok", "disconnected", or the status class (classify)."""
    if leave_after is None:
        return classify((await http.post(url, json=body)).status_code)
    try:
        r = await asyncio.wait_for(http.post(url, json=body), leave_after)
    except TimeoutError:
        return "disconnected"
    return classify(r.status_code)


async def stream(http: httpx.AsyncClient, url: str, body: dict, leave_after: int | None,
                 counts: Counter) -> None:
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            counts[classify(r.status_code)] += 1
            return
        events = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                if '"error"' in line[:20]:
                    counts["5xx"] += 1  # an error after the 200 went out
                    return
                events += 1
                if leave_after is not None and events >= leave_after:
                    counts["disconnected"] += 1
                    return
    counts["ok"] += 1


def classify(status: int) -> str:
    return "ok" if status == 200 else ("5xx" if status >= 500 else f"http_{status}")


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def idle_leak(url: str) -> tuple[float, float]:
    """KV blocks in use and prefix-cache blocks once nothing runs or waits."""
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        for _ in range(100):
            text = (await http.get(url + "/metrics")).text
            if metric(text, "vllm:num_requests_running") == 0 and \
                    metric(text, "vllm:num_requests_waiting") == 0:
                await asyncio.sleep(0.5)  # one more step applies the last releases
                text = (await http.get(url + "/metrics")).text
                return metric(text, "justllm_kv_blocks_used"), \
                    metric(text, "justllm_prefix_cache_blocks")
            await asyncio.sleep(0.2)
    return float("nan"), float("nan")


async def soak(url: str, cfg: SoakConfig) -> Counter:
    """Run the clients; counts of requests, ok, 5xx (status or an error event in a 200 stream),
    disconnected, transport errors and other statuses."""
    counts: Counter = Counter()
    deadline = time.monotonic() + cfg.seconds
    await asyncio.gather(*(client(i, url, cfg, deadline, counts) for i in range(cfg.clients)))
    return counts
