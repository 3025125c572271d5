"""What the KV the prefix cache keeps costs a decode step.

Not a test. llama.cpp attends over every used cell of its unified cache, the other sequences'
masked (docs/llama-cpp-facts.md, "How much of the KV cache a step reads"), so the KV that
finished requests leave in the prefix cache is read again by every later step. Two engines in
one process decode the same load in turn (engine_throughput.py's greedy ``measure``): one whose
cache holds about ``--cached`` tokens (finished requests with distinct long prompts), one whose
cache is flushed before each run. Both keep every prefix in the KV (``--cache-ram 0``: no host
memory, no share of the pool for idle prefixes), which is what is measured.
They take turns because this machine's speed drifts by 10-15% within a minute.

    .venv/bin/python benchmarks/cached_kv_cost.py [MODEL] [--cached 4000,9000,14000]
        [--streams 8] [--tokens 48] [--rounds 2] [--pool-blocks 1024] [--gpu] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import measure, time_sampling  # noqa: E402  (its decode timing)

WORDS = ("sea ship wind storm harbour sail captain island wave rope anchor gull tide coast "
         "night lantern deck mast keel chart").split()


def cached_tokens(engine: Engine) -> int:
    return engine.stats().prefix_cache.blocks * engine.config.block_size


def fill(engine: Engine, target: int, rng: random.Random) -> int:
    """Finished requests with distinct ~500-word prompts until the cache holds ``target``
    tokens or stops growing (its sequence ids run out first with short prompts)."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    stalled = 0
    while cached_tokens(engine) < target and stalled < 3:
        before = cached_tokens(engine)
        for _ in range(4):
            engine.add_request(" ".join(rng.choice(WORDS) for _ in range(500)), params)
        while engine.has_unfinished():
            engine.step()
        stalled = stalled + 1 if cached_tokens(engine) <= before else 0
    return cached_tokens(engine)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--cached", default="4000,9000,14000",
                    help="cache sizes to reach, in tokens, ascending")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pool-blocks", type=int, default=1024,
                    help="each engine's KV pool in blocks of 16 (both alike)")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # (each prompt the load sends again is held by a holder of its own that the request then
    # locks: the default spare ids, one per stream and more, leave every request an id)
    config = EngineConfig(model=args.model, max_seqs=args.streams, pool_blocks=args.pool_blocks,
                          gpu=args.gpu, cache_ram=0)
    kept, fresh = Engine(config), Engine(config)
    for engine in (kept, fresh):
        time_sampling(engine)  # (measure reads its counter)
    rng = random.Random(0)
    rows = []
    print(f"{'cached':>7} {'with it':>8} {'without':>8} {'ratio':>6}")
    for target in (int(t) for t in args.cached.split(",")):
        held = fill(kept, target, rng)
        with_it, without = [], []
        for _ in range(args.rounds):
            with_it.append(measure(kept, args.streams, args.tokens)[0])
            fresh.flush_prefix_cache()
            without.append(measure(fresh, args.streams, args.tokens)[0])
        a, b = statistics.median(with_it), statistics.median(without)
        rows.append({"cached_tokens": held, "streams": args.streams, "tok_s_cached": a,
                     "tok_s_without": b, "ratio": a / b})
        print(f"{held:>7} {a:>8.1f} {b:>8.1f} {a / b:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": config.model, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
