"""Routing policies against prefix caches: several ~1,000-token prefixes, a few questions each,
sent through a gateway in front of two replicas of one model, once per policy (issue's
benchmark: 4 prefixes x 8 questions, 2 replicas, interleaved, 4 concurrent; cache-aware
should reach a prefix-cache hit ratio >= 0.9 where round-robin gets ~0.5, and a TTFT p50 >= 3x
lower). Not a test. Loopback only; starts and stops its own gateways.

    python benchmarks/routing_bench.py                                   # both policies
    python benchmarks/routing_bench.py --policies round-robin --threads 1 --json out.json
    python benchmarks/routing_bench.py --order shuffled                  # see below

For each policy a fresh `justllm serve --models` gateway starts (so both runners' caches start
empty) with the model as ``replicas: 2`` and that ``routing:``; once both replicas are ready,
``--concurrency`` clients take the requests in order from one queue: p0q0, p1q0, p2q0, p3q0,
p0q1, ... (``--order shuffled``: the same requests in a seeded random order). Each request is
a streamed greedy completion of ``--max-tokens`` tokens; TTFT is measured here, from sending
to the first chunk with text. The prefix-cache counters come from the gateway's /metrics
(every runner's series, labelled by replica) before and after the run.

Per policy it prints: the token hit ratio (prompt tokens found in the prefix cache / looked
up, summed over replicas), the request hit ratio (requests that reused a cached prefix), both
again leaving out each prefix's first request (which no cache can hold), TTFT p50/p90, the
wall time, which replicas each prefix's requests went to, and the gateway's decisions by
reason; then round-robin's TTFT p50 over cache-aware's.

The request counts are the runners' lookups: a request preempted and admitted again is
looked up (and counted) again.

Notes on the issue's numbers. With the interleaved order, an even number of prefixes and 2
replicas, round-robin sends request k to replica k % 2, so every prefix stays on one replica
(as long as requests reach the gateway in the order they were sent) and both policies score
the same; ``--order shuffled`` breaks that. With serve's default pool (1024 blocks of 16
tokens) each replica holds all 4 prefixes, so round-robin misses only a prefix's first request
on each replica (hit ratio ~0.75, and the TTFT p50 is a hit's for both); a pool that holds
about two prefixes (``--pool-blocks 192``) makes it evict. Each prefix's first request always
misses, so the hit ratio over all requests is at most (questions - 1) / questions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from justllm.gateway.runner import free_port
from justllm.models.source import resolve_model

MODEL = "demo"
COUNTERS = {"queried": "vllm:prefix_cache_queries_total", "hit_tokens": "vllm:prefix_cache_hits_total",
            "hits": "justllm_prefix_cache_hits_total", "misses": "justllm_prefix_cache_misses_total"}
TOPICS = ["Astronomy", "Bakery", "Carpentry", "Diplomacy", "Estuaries", "Falconry", "Glaciers",
          "Harbours", "Irrigation", "Jewellery", "Kilns", "Lighthouses"]
WORDS = """river mountain village market winter summer garden library window teacher farmer
merchant soldier doctor painter sailor engineer child kitchen bridge forest valley harbour
castle station letter journey evening morning storm candle lantern orchard meadow island
desert canyon glacier volcano compass map ladder wagon engine clock mirror blanket basket
bottle feather stone silver copper timber cotton wool bread cheese honey apple pear plum
carries builds finds watches follows remembers describes repairs measures gathers counts
opens closes paints writes reads sells buys borrows lends guards visits crosses climbs
quietly slowly carefully often rarely early late together alone again always never almost
old new small large bright dark warm cold quiet busy narrow wide ancient gentle heavy
light distant nearby hidden famous simple strange careful patient honest clever""".split()
QUESTIONS = ["What is the main subject of the text above?",
             "Name one place mentioned in the text.",
             "Who is the first person described?",
             "Summarise the first sentence in five words.",
             "What season is mentioned most often?",
             "Which object appears in the last sentence?",
             "Is the tone of the text happy or sad?",
             "Give a title for the text.",
             "What does the merchant do in the text?",
             "List two animals or plants from the text.",
             "How many people are named in the text?",
             "What happens at the end of the text?"]


# ---- the workload -----------------------------------------------------------------------------


def count_tokens(model_path: str):
    """A token counter with the model's own tokenizer (vocab only: no weights loaded)."""
    from llama_cpp import Llama

    vocab = Llama(model_path=model_path, vocab_only=True, verbose=False)
    return lambda text: len(vocab.tokenize(text.encode(), add_bos=True, special=False))


def make_prefix(index: int, tokens: int, n_tokens) -> str:
    """Deterministic English-ish text of about ``tokens`` tokens, distinct from its first word
    (a topic of its own) so no two prefixes share a KV block."""
    rng = random.Random(1000 + index)
    topic = TOPICS[index % len(TOPICS)] + (f" {index}" if index >= len(TOPICS) else "")
    sentences = [f"{topic}: notes on {topic.lower()}."]
    text = sentences[0]
    while n_tokens(text) < tokens:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        sentences.append(" ".join(words).capitalize() + ".")
        text = " ".join(sentences)
    while len(sentences) > 1 and n_tokens(text) > tokens:  # the last sentence overshot
        words = sentences[-1].rstrip(".").split()
        sentences[-1] = " ".join(words[:-1]) + "." if len(words) > 1 else ""
        if not sentences[-1]:
            sentences.pop()
        text = " ".join(sentences)
    return text


def make_requests(args, prefixes: list[str]) -> list[tuple[int, int, str]]:
    """(prefix, question, prompt) in the order they are sent."""
    questions = [QUESTIONS[q % len(QUESTIONS)] + (f" ({q})" if q >= len(QUESTIONS) else "")
                 for q in range(args.questions)]
    order = [(p, q) for q in range(args.questions) for p in range(args.prefixes)]
    if args.order == "shuffled":
        random.Random(args.seed).shuffle(order)
    return [(p, q, f"{prefixes[p]}\n\nQuestion: {questions[q]}\nAnswer:") for p, q in order]


# ---- the gateway ------------------------------------------------------------------------------


def start_gateway(config: Path, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (workdir / "gateway.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "justllm", "serve", "--models", str(config),
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "JUSTLLM_CACHE_DIR": str(workdir / "cache")})
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, replicas: int, timeout: float) -> dict:
    """Until every replica of the model is ready; the model's /models row."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}")
        try:
            rows = httpx.get(url + "/models", timeout=5, trust_env=False).json()["data"]
            row = next(r for r in rows if r["model"] == MODEL)
            if row["status"] == "failed":
                raise RuntimeError(f"the model failed to load: {row['error']}")
            ready = [r for r in row["replicas"] if r["status"] == "ready"]
            if len(ready) >= replicas:
                return row
        except (httpx.HTTPError, ValueError, KeyError, StopIteration):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the replicas were not ready within {timeout:.0f} s")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, parent not reaped yet) is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def stop_gateway(proc: subprocess.Popen, runner_pids: list[int], grace: float = 60.0) -> None:
    """SIGTERM (the gateway stops its runners), then SIGKILL to its whole process group on
    timeout; any runner still alive after that is killed by pid."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    reap(runner_pids)


def reap(runner_pids: list[int] | set[int]) -> None:
    """Give runners 15 s to follow their stopped gateway out, then SIGKILL any left."""
    deadline = time.monotonic() + 15
    while any(alive(p) for p in runner_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in runner_pids:
        if alive(pid):
            print(f"warning: runner {pid} outlived its gateway; killing it", file=sys.stderr)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def snapshot(url: str) -> dict[str, dict[str, float]]:
    """Per replica of the model, the prefix-cache counters on the gateway's /metrics."""
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    names = {v: k for k, v in COUNTERS.items()}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names and s.labels.get("model_name") == MODEL and "replica" in s.labels:
                row = out.setdefault(s.labels["replica"], dict.fromkeys(COUNTERS, 0.0))
                row[names[s.name]] += s.value
    return out


# ---- one run ----------------------------------------------------------------------------------


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = first = None
    usage: dict = {}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        replica = r.headers.get("x-replica")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error in stream: {chunk['error']}")
            if chunk.get("choices"):
                first = now if first is None else first
                if ttft is None and chunk["choices"][0].get("text"):
                    ttft = now
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft": ttft if ttft is not None else first, "latency": time.perf_counter() - t0,
            "replica": replica, "prompt_tokens": usage.get("prompt_tokens")}


async def workload(url: str, requests: list[tuple[int, int, str]], args) -> tuple[list, float]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in requests:
        queue.put_nowait(item)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=900, trust_env=False, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                p, q, prompt = queue.get_nowait()
                res = await one(client, url, prompt, args.max_tokens)
                results.append({"prefix": p, "question": q, **res})

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(args.concurrency)])
        return results, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_policy(policy: str, args, requests: list[tuple[int, int, str]]) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"routing-bench-{policy}-"))
    entry = {"source": args.model, "replicas": 2, "routing": policy, "preload": True, "ttl": -1,
             "max-seqs": args.max_seqs or args.concurrency, "threads": args.threads}
    if args.pool_blocks:
        entry["pool-blocks"] = args.pool_blocks
    config = workdir / "models.yaml"
    config.write_text(json.dumps({"models": {MODEL: entry}}))
    proc, url = start_gateway(config, workdir)
    runner_pids: list[int] = []
    ok = False
    try:
        t_load = time.perf_counter()
        row = wait_ready(proc, url, 2, args.load_timeout)
        load_s = time.perf_counter() - t_load
        runner_pids = [r["pid"] for r in row["replicas"] if r.get("pid")]
        before = snapshot(url)
        results, wall = asyncio.run(workload(url, requests, args))
        time.sleep(0.5)  # let the runners' counters settle after the last stream
        after = snapshot(url)
        row = next(r for r in httpx.get(url + "/models", timeout=10, trust_env=False)
                   .json()["data"] if r["model"] == MODEL)
        runner_pids = sorted({*runner_pids, *(r["pid"] for r in row["replicas"] if r["pid"])})
        ok = True
    finally:
        stop_gateway(proc, runner_pids)
        if not ok:
            print(f"{policy}: failed; gateway and runner logs kept in {workdir}", file=sys.stderr)
            log = workdir / "gateway.log"
            if log.exists():
                print("".join(log.read_text(errors="replace").splitlines(True)[-20:]),
                      file=sys.stderr)
        elif not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
    delta = {rep: {k: after[rep][k] - before.get(rep, {}).get(k, 0.0) for k in COUNTERS}
             for rep in after}
    tot = {k: sum(d[k] for d in delta.values()) for k in COUNTERS}
    # Each prefix's first request can find nothing cached (fresh runners, distinct prefixes):
    # leaving it out is leaving out its lookups, all misses.
    firsts = {}
    for i, (p, _, _) in enumerate(requests):
        firsts.setdefault(p, i)
    by_index = {(r["prefix"], r["question"]): r for r in results}
    first_tokens = sum(by_index[requests[i][:2]]["prompt_tokens"] or 0 for i in firsts.values())
    ttfts = [r["ttft"] for r in results]
    spread = {p: dict(sorted(Counter(r["replica"] for r in results if r["prefix"] == p).items()))
              for p in range(args.prefixes)}
    prompt_tokens = [r["prompt_tokens"] for r in results if r["prompt_tokens"]]
    n_req = tot["hits"] + tot["misses"]
    return {
        "policy": policy, "requests": len(results), "load_s": round(load_s, 1),
        "wall_s": round(wall, 2),
        "token_hit_ratio": tot["hit_tokens"] / tot["queried"] if tot["queried"] else None,
        "request_hit_ratio": tot["hits"] / n_req if n_req else None,
        "token_hit_ratio_after_first": (tot["hit_tokens"] / (tot["queried"] - first_tokens)
                                        if tot["queried"] > first_tokens else None),
        "request_hit_ratio_after_first": (tot["hits"] / (n_req - len(firsts))
                                          if n_req > len(firsts) else None),
        "ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * pct(ttfts, 0.9),
        "latency_p50_ms": 1000 * statistics.median(r["latency"] for r in results),
        "prompt_tokens_min": min(prompt_tokens, default=None),
        "prompt_tokens_max": max(prompt_tokens, default=None),
        "spread": spread, "decisions": {k: v for k, v in row["decisions"].items() if v},
        "per_replica": {rep: {k: int(v) for k, v in d.items()} for rep, d in sorted(delta.items())},
        "per_request": [{k: r[k] for k in ("prefix", "question", "replica", "ttft",
                                           "prompt_tokens")} for r in results],
    }


# ---- report -----------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def report(runs: list[dict], args, prompt_tokens: list[int]) -> float | None:
    print(f"{args.prefixes} prefixes x {args.questions} questions = "
          f"{args.prefixes * args.questions} requests, 2 replicas, {args.concurrency} concurrent, "
          f"order {args.order}, max_tokens {args.max_tokens}, threads/runner {args.threads}")
    print(f"prefix tokens (tokenizer): {prompt_tokens}; prompt tokens per request (runner "
          f"usage): {min(r['prompt_tokens_min'] for r in runs)}-"
          f"{max(r['prompt_tokens_max'] for r in runs)}")
    print()
    head = (f"{'policy':12} {'req':>4} {'tok hit':>8} {'req hit':>8} {'tok hit*':>9} "
            f"{'req hit*':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'wall s':>7}")
    print(head)
    print("-" * len(head))
    for r in runs:
        print(f"{r['policy']:12} {r['requests']:4d} {fmt(r['token_hit_ratio']):>8} "
              f"{fmt(r['request_hit_ratio']):>8} {fmt(r['token_hit_ratio_after_first']):>9} "
              f"{fmt(r['request_hit_ratio_after_first']):>9} {r['ttft_p50_ms']:8.0f}ms "
              f"{r['ttft_p90_ms']:8.0f}ms {r['wall_s']:7.1f}")
    print("  (* leaving out each prefix's first request; TTFT measured by the client)")
    for r in runs:
        print(f"\n{r['policy']}: decisions {r['decisions']}; replicas ready in {r['load_s']} s")
        for p, counts in r["spread"].items():
            print(f"  prefix {p} -> {counts}")
        for rep, d in r["per_replica"].items():
            print(f"  replica {rep}: {d['hits']} hit / {d['misses']} miss lookups, "
                  f"{d['hit_tokens']} of {d['queried']} prompt tokens cached")
    by = {r["policy"]: r for r in runs}
    ratio = None
    if "cache-aware" in by and "round-robin" in by:
        ratio = by["round-robin"]["ttft_p50_ms"] / by["cache-aware"]["ttft_p50_ms"]
        print(f"\nTTFT p50 round-robin / cache-aware: {ratio:.2f}x")
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the demo model)")
    ap.add_argument("--policies", default="cache-aware,round-robin",
                    help="comma-separated routing policies, one fresh gateway each")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per runner")
    ap.add_argument("--max-seqs", type=int, default=0, help="per runner (default: concurrency)")
    ap.add_argument("--pool-blocks", type=int, default=0, help="per runner (default: serve's)")
    ap.add_argument("--order", choices=["interleaved", "shuffled"], default="interleaved")
    ap.add_argument("--seed", type=int, default=0, help="for --order shuffled")
    ap.add_argument("--load-timeout", type=float, default=300.0)
    ap.add_argument("--keep-logs", action="store_true", help="keep each run's temp dir")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.model = resolve_model(args.model)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    n_tokens = count_tokens(args.model)
    prefixes = [make_prefix(p, args.prefix_tokens, n_tokens) for p in range(args.prefixes)]
    prefix_tokens = [n_tokens(p) for p in prefixes]
    requests = make_requests(args, prefixes)
    runs = []
    for policy in policies:
        print(f"running {policy} ...", file=sys.stderr, flush=True)
        runs.append(run_policy(policy, args, requests))
    ratio = report(runs, args, prefix_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "prefix_tokens": prefix_tokens, "runs": runs, "ttft_p50_ratio_rr_over_ca": ratio},
            indent=2))


if __name__ == "__main__":
    main()
