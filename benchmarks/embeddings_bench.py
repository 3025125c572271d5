"""Embeddings benchmark: inputs per second for the shapes an indexing client sends.

Not a test. Against any OpenAI-compatible server (loopback only):

    justllm serve MODEL --port 8080
    python benchmarks/embeddings_bench.py --url http://127.0.0.1:8080 [--repeat 3]

Each case is one ``/v1/embeddings`` request, sent ``--repeat`` times one after another
(after one warm-up request): 64 short sentences (~16 tokens each, a RAG indexing call),
8 paragraphs (~200 tokens), one document (~2,000 tokens), and ``--concurrent`` one-sentence
requests sent together (queries at search time). Prints inputs/s and tokens/s per case (the
best of the repeats: the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

WORDS = ("river stone lantern harbor meadow copper signal orchard winter canyon velvet "
         "engine market silver thunder garden pencil ladder violet compass").split()


def sentence(i: int, words: int) -> str:
    """A distinct sentence of about ``words`` words (no two inputs alike: no cache helps)."""
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words)) + f" #{i}."


CASES = {
    "64 x ~16 tokens": [sentence(i, 12) for i in range(64)],
    "8 x ~200 tokens": [sentence(i, 190) for i in range(8)],
    "1 x ~2,000 tokens": [sentence(0, 1950)],
}


async def embed(client: httpx.AsyncClient, url: str, inputs: list[str]) -> int:
    r = await client.post(url + "/v1/embeddings", json={"input": inputs})
    r.raise_for_status()
    body = r.json()
    assert len(body["data"]) == len(inputs)
    return int(body["usage"]["prompt_tokens"])


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=16)
    args = ap.parse_args()
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        await embed(client, args.url, ["warm-up"])
        for name, inputs in CASES.items():
            best = float("inf")
            tokens = 0
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                tokens = await embed(client, args.url, inputs)
                best = min(best, time.perf_counter() - t0)
            print(f"{name:>24}: {len(inputs) / best:8.1f} inputs/s  {tokens / best:8.0f} "
                  f"tokens/s  ({tokens} tokens, {best:.2f} s)", flush=True)
        name = f"{args.concurrent} requests x 1"
        best = float("inf")
        for r in range(args.repeat):
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(embed(client, args.url, [sentence(100 * r + i, 12)])
                                            for i in range(args.concurrent)))
            best = min(best, time.perf_counter() - t0)
        print(f"{name:>24}: {args.concurrent / best:8.1f} inputs/s  {sum(counts) / best:8.0f} "
              f"tokens/s  ({sum(counts)} tokens, {best:.2f} s)", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
