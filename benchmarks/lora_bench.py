"""Aggregate decode throughput with LoRA adapters, and what an adapter switch costs.

Not a test. llama.cpp applies adapters per context, so a step serves one adapter set: streams
of different adapters take turns (``--lora-max-steps`` consecutive steps each) instead of
sharing a batch. Prints tok/s of ``--streams`` streams (8) under the base model alone, one
adapter, and 2 and 4 adapters mixed evenly, for each ``--max-steps`` bound; then the switch cost
per step: bare ``llama_decode`` of one token per stream with the adapter set changed before
every step vs kept (llama.cpp rebuilds its compute graph after a change). The adapters are
random rank-8 deltas on attn_q/attn_v (tests/lora_files.py).

    .venv/bin/python benchmarks/lora_bench.py [MODEL] [--streams 8] [--tokens 48]
        [--max-steps 1,4] [--rank 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from justllm.config import EngineConfig, LoraSpec  # noqa: E402
from justllm.core.sampling_params import SamplingParams  # noqa: E402
from justllm.engine.engine import Engine  # noqa: E402
from justllm.models.source import resolve_model  # noqa: E402
from tests.lora_files import write_adapter  # noqa: E402

NAMES = ("a", "b", "c", "d")


def measure(engine: Engine, n_streams: int, n_sets: int, tokens: int) -> dict[str, float]:
    """Decode tok/s of ``n_streams`` streams spread evenly over ``n_sets`` adapters (0: the
    base model), timed from the moment every stream has its first token."""
    switches0 = engine.stats().lora_switches
    ids = []
    for i in range(n_streams):
        lora = ((NAMES[i % n_sets], 1.0),) if n_sets else ()
        params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True, lora=lora)
        ids.append(engine.add_request(f"Request {i}: write a long story about the sea.", params))
    started: set[str] = set()
    while len(started) < n_streams:
        started |= {o.request_id for o in engine.step()}
    t0 = time.perf_counter()
    steps = produced = 0
    switches = engine.stats().lora_switches
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
        steps += 1
    wall = time.perf_counter() - t0
    return {"tok_s": produced / wall, "ms_per_step": 1000 * wall / steps,
            "switches": engine.stats().lora_switches - switches,
            "switches_total": engine.stats().lora_switches - switches0}


def switch_cost(engine: Engine, n: int, reps: int = 30) -> dict[str, float]:
    """Median ms of one bare decode step (``n`` sequences, one token each) with the same
    adapter throughout, and with the adapter set changed before every step."""
    b = engine.backend
    adapters = {a.name: a.adapter for a in engine.lora_adapters()}
    engine.flush_prefix_cache()
    engine.step()
    b.clear_kv()
    prompt = b.tokenize("Write a long story about the sea.")[:8]
    m = len(prompt)
    for s in range(n):
        b.batch_tokens[:m], b.batch_pos[:m] = prompt, range(m)
        b.batch_seq[:m], b.batch_n_seq[:m], b.batch_logits[:m] = s, 1, 0
        b.batch_logits[m - 1] = 1
        b.decode(m)
    pos = m

    def one(adapter: str) -> float:
        nonlocal pos
        b.set_loras(((adapters[adapter], 1.0),))
        b.batch_tokens[:n], b.batch_pos[:n] = prompt[1], pos
        b.batch_seq[:n], b.batch_n_seq[:n], b.batch_logits[:n] = range(n), 1, 1
        t0 = time.perf_counter()
        b.decode(n)
        pos += 1
        return time.perf_counter() - t0

    one("a")
    same = [one("a") for _ in range(reps)]
    alternating = [one("b" if i % 2 else "a") for i in range(reps)]
    b.set_loras(())
    b.clear_kv()
    engine.loras._applied = ()  # the registry's view of the context, reset with it
    s, a = statistics.median(same) * 1000, statistics.median(alternating) * 1000
    return {"same_ms": s, "switching_ms": a, "switch_cost_ms": a - s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--max-steps", default="1,4", help="--lora-max-steps values to compare")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = resolve_model(args.model)
    results: dict[str, object] = {"streams": args.streams, "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as d:
        specs = tuple(LoraSpec(n, str(write_adapter(Path(d) / f"{n}.gguf", seed=i,
                                                    rank=args.rank)))
                      for i, n in enumerate(NAMES))
        for bound in [int(x) for x in args.max_steps.split(",")]:
            engine = Engine(EngineConfig(model=model, max_seqs=args.streams, pool_blocks=256,
                                         lora=specs, lora_max_steps=bound,
                                         threads=args.threads))
            try:
                measure(engine, args.streams, 0, 4)  # warm-up
                print(f"--lora-max-steps {bound}: {args.streams} streams x {args.tokens} tokens")
                print(f"{'adapters':>10} {'tok/s':>8} {'ms/step':>8} {'switches':>9}")
                for n_sets in (0, 1, 2, 4):
                    r = measure(engine, args.streams, n_sets, args.tokens)
                    label = "base" if n_sets == 0 else str(n_sets)
                    print(f"{label:>10} {r['tok_s']:8.1f} {r['ms_per_step']:8.1f} "
                          f"{r['switches']:9.0f}")
                    results[f"max_steps={bound}/adapters={label}"] = r
                if bound == int(args.max_steps.split(",")[0]):
                    sc = switch_cost(engine, args.streams)
                    results["switch"] = sc
                    print(f"switch cost: one step of {args.streams} tokens {sc['same_ms']:.1f} ms "
                          f"with the same adapter, {sc['switching_ms']:.1f} ms when the set "
                          f"changes before it: {sc['switch_cost_ms']:+.1f} ms per switch")
            finally:
                engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
