"""Aggregate decode throughput of the engine at 1..32 concurrent sequences.

Not a test: prints tok/s per concurrency and the share of each step spent outside llama_decode
(Python: scheduling, batch filling, sampling, detokenizing). Prefill is excluded: timing starts
once every sequence has its first token.

    .venv/bin/python benchmarks/engine_throughput.py [MODEL] [--tokens 64] [--levels 1,4,8,16,32]
        [--gpu] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Engine


def measure(engine: Engine, n: int, tokens: int) -> tuple[float, float, float]:
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True)
    ids = [engine.add_request(f"Request {i}: write a long story about the sea.", params)
           for i in range(n)]
    started: set[str] = set()
    while len(started) < n:  # prefill and first tokens
        started |= {o.request_id for o in engine.step()}
    t0 = time.perf_counter()
    d0 = engine.backend.decode_seconds
    steps = produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
        steps += 1
    wall = time.perf_counter() - t0
    in_llama = engine.backend.decode_seconds - d0
    assert all(i not in engine._live for i in ids)
    return produced / wall, (wall - in_llama) / wall, wall / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,4,8,16,32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--gpu", action="store_true", help="offload every layer (a GPU build)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    seqs = max(32, *levels)
    engine = Engine(EngineConfig(model=args.model, max_seqs=seqs, max_decode=seqs,
                                 pool_blocks=max(1024, seqs * (args.tokens + 32) // 16 + 64),
                                 threads=args.threads, gpu=args.gpu or EngineConfig().gpu))
    measure(engine, 2, 4)  # warm-up
    print(f"{'seqs':>5} {'tok/s':>8} {'python %':>9} {'ms/step':>8}")
    rows = []
    for n in levels:
        rate, py_share, step = measure(engine, n, args.tokens)
        rows.append({"seqs": n, "tok_s": rate, "python_share": py_share, "ms_per_step": 1000 * step})
        print(f"{n:>5} {rate:>8.1f} {100 * py_share:>8.1f}% {1000 * step:>8.1f}")
    engine.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": engine.config.gpu, "tokens": args.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
