"""Speculative decoding vs plain decoding, single stream and 8 streams, on repetitive and
ordinary text.

Not a test: prints generated tok/s (first token to last, prefill excluded as far as one
clock allows: timing starts once every request has its first token), steps, and the
acceptance rate for each proposer. Greedy, ``ignore_eos`` so every run makes the same number
of tokens.

    .venv/bin/python benchmarks/spec_bench.py [--model M] [--draft D] [--tokens 128]
        [--streams 1,8] [--methods plain,ngram,draft,tree] [--repeat 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Engine
from justllm.models.source import resolve_model

DOCUMENT = (
    "The committee met on Tuesday to review the budget for the new library. The chair "
    "opened the meeting by thanking the volunteers who had organised the book sale, which "
    "raised more than four thousand pounds. The treasurer then presented the accounts and "
    "noted that heating costs had risen by a third since last winter.")
CODE = (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n"
    "    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n\n"
    "    def size(self):\n        return len(self.items)\n\n\n")
REPETITIVE = [
    f"Document:\n{DOCUMENT}\n\nThe same document, quoted word for word:\n",
    f"{CODE}# The same class again, unchanged:\n",
    f"Minutes:\n{DOCUMENT}\n\nCopy of the minutes:\n",
    f"{CODE}# A copy of the class above:\n",
]
ORDINARY = [
    "Once upon a time, in a small village by the sea,",
    "The history of the bicycle begins in",
    "Here are some tips for learning to cook:",
    "The weather in the mountains can change quickly because",
]


def run(engine: Engine, prompts: list[str], tokens: int) -> tuple[float, int, float]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    started: set[str] = set()
    produced = 0
    while len(started) < len(ids):
        for o in engine.step():
            started.add(o.request_id)
            produced += len(o.token_ids)
    s0 = engine.stats().spec
    t0 = time.perf_counter()
    steps = 0
    first = produced
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
        steps += 1
    wall = time.perf_counter() - t0
    s1 = engine.stats().spec
    drafted = s1.num_draft_tokens - s0.num_draft_tokens
    accepted = s1.num_accepted_tokens - s0.num_accepted_tokens
    return (produced - first) / wall, steps, (accepted / drafted if drafted else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--draft", help="draft GGUF for the draft and tree methods")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--methods", default="plain,ngram")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2, help="runs per cell; the median is shown")
    args = ap.parse_args()
    model = resolve_model(args.model)
    methods = args.methods.split(",")
    # Every engine loaded first, then the methods take turns on each cell: this machine's
    # speed drifts by 10-20% over minutes, so back-to-back runs compare fairly.
    engines = {}
    for method in methods:
        spec = "" if method == "plain" else method
        engines[method] = Engine(EngineConfig(
            model=model, max_seqs=8, pool_blocks=512, prefix_cache=False, spec=spec,
            draft_model=resolve_model(args.draft) if spec in ("draft", "tree") else None,
            gamma=args.gamma))
        run(engines[method], ORDINARY[:1], 4)  # warm-up
    print(f"{'method':>6} {'text':>10} {'streams':>7} {'tok/s':>7} {'vs plain':>8} "
          f"{'steps':>6} {'accept':>7}")
    for name, prompts in (("repetitive", REPETITIVE), ("ordinary", ORDINARY)):
        for n in (int(x) for x in args.streams.split(",")):
            batch = [prompts[i % len(prompts)] for i in range(n)]
            results: dict[str, list[tuple[float, int, float]]] = {m: [] for m in methods}
            for _ in range(args.repeat):
                for method in methods:
                    results[method].append(run(engines[method], batch, args.tokens))
            base = statistics.median(r[0] for r in results.get("plain", [(float("nan"),)]))
            for method in methods:
                rate = statistics.median(r[0] for r in results[method])
                steps = results[method][0][1]
                acc = statistics.median(r[2] for r in results[method])
                print(f"{method:>6} {name:>10} {n:>7} {rate:7.1f} {rate / base:7.2f}x "
                      f"{steps:>6} {acc:7.0%}", flush=True)
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
