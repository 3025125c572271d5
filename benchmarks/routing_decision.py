"""The gateway's cache-aware routing decision: time per request with many cached prefixes.

Not a test; no model, no server (justllm/gateway/routing.py is pure):

    python benchmarks/routing_decision.py [--prefixes 10000] [--chars 1000] [--replicas 4]

A CacheAware router's tree is filled with ``--prefixes`` distinct prompts of about ``--chars``
characters spread over ``--replicas`` replicas; a third of them begin with one of 20 shared
system prompts. Then ``--requests`` new requests are timed, each one ``choose`` (match, the
decision, the insert of the chosen path and any eviction): a third follow-ups of a cached
prompt, a third new conversations under a shared system prompt, a third new text. Two runs:
a cap above the fill (nothing evicted), and a cap at the fill (every insert evicts). The goal
(issue #13) is under 1 ms a decision at 10,000 cached prefixes. The max includes Python's
cyclic garbage collector passing over the tree's nodes now and then (gen-2: milliseconds).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from justllm.gateway.routing import (
    CacheAware,
    PrefixTree,
    ReplicaLoad,
    RouteRequest,
    RoutingConfig,
)

WORDS = ("the", "model", "answers", "every", "question", "about", "gardens", "with", "care",
         "and", "cites", "sources", "while", "keeping", "replies", "short", "clear", "kind")


def words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:chars]


def prompts(rng: random.Random, n: int, chars: int, systems: list[str]) -> list[str]:
    made = []
    for i in range(n):
        head = f"[{i}] "  # distinct from the start...
        if i % 3 == 0:  # ...or after a shared system prompt
            head = rng.choice(systems) + head
        made.append(head + words(rng, chars - len(head)))
    return made


def run(args: argparse.Namespace, evicting: bool) -> None:
    rng = random.Random(args.seed)
    systems = [f"System {k}: " + words(rng, 400) for k in range(20)]
    cached = prompts(rng, args.prefixes, args.chars, systems)
    ids = [f"r{k}" for k in range(args.replicas)]
    tree = PrefixTree()
    for i, p in enumerate(cached):
        tree.insert(p, ids[i % len(ids)])
    fullest = max(tree.chars(r) for r in ids)
    # Evicting: a cap at the emptiest replica's fill, so from then on every insert evicts.
    cap = min(tree.chars(r) for r in ids) if evicting else 10**12
    router = CacheAware(RoutingConfig(max_prefix_chars=max(args.chars * 2, 4096),
                                      max_tree_chars=cap))
    router.tree = tree
    for r in ids:
        tree.evict(r, cap)

    requests = []
    for i in range(args.requests):
        kind = i % 3
        if kind == 0:
            text = rng.choice(cached) + "\nUser: and then? " + words(rng, 60)
        elif kind == 1:
            text = rng.choice(systems) + f"<new {i}> " + words(rng, args.chars - 400)
        else:
            text = f"<fresh {i}> " + words(rng, args.chars)
        loads = [ReplicaLoad(r, running=rng.randint(0, 40), waiting=rng.randint(0, 4),
                             kv_usage=rng.random(), ttft_p50=rng.uniform(0.05, 0.5))
                 for r in ids]
        requests.append((RouteRequest(text), loads))

    gc.collect()  # not the previous run's garbage in this run's times
    times = []
    for request, loads in requests:
        t0 = time.perf_counter_ns()
        router.choose(request, loads)
        times.append((time.perf_counter_ns() - t0) / 1000)
    times.sort()
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
    print(f"{'at the cap' if evicting else 'no eviction'}: {args.prefixes:,} prefixes x "
          f"~{args.chars:,} chars over {args.replicas} replicas ({fullest:,} chars on the "
          f"fullest; cap {f'{cap:,}' if evicting else 'none'} per replica)")
    print(f"  choose (match + decision + insert + eviction), {len(times):,} requests: "
          f"median {statistics.median(times):.1f} us, p99 {p99:.1f} us, max {times[-1]:.1f} us")
    print(f"  decisions: {dict(router.counts)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefixes", type=int, default=10_000)
    ap.add_argument("--chars", type=int, default=1_000)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--requests", type=int, default=6_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    run(args, evicting=False)
    run(args, evicting=True)


if __name__ == "__main__":
    main()
