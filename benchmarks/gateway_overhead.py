"""What the router-mode gateway costs: the same workload straight to a runner and through the
gateway in front of it, taking turns, plus the cold start of an unloaded model and the
gateway's own memory (issue #12's benchmark). Not a test. Loopback only.

    python benchmarks/gateway_overhead.py --rounds 3 -- --max-seqs 8

Each round runs `justllm bench` (random prompts, --concurrency streams, --output-len tokens,
greedy) against the runner and then the gateway, with a fresh seed per round so neither side
gets the other's prefix-cache hits. Prints the medians over rounds of output tok/s, TTFT p50
and ITL p50 for both, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_soak import start_server  # noqa: E402
from reliability_soak import proc_stats  # noqa: E402

from justllm.models.source import resolve_model  # noqa: E402


def bench(url: str, model: str, args, seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "justllm", "bench", "--url", url, "--model-name",
                        model, "-c", str(args.concurrency), "-n", str(args.num_requests),
                        "--output-len", str(args.output_len), "--seed", str(seed),
                        "--json", out.name], check=True, capture_output=True)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("runner_args", nargs="*", help="engine flags for the runner (after --)")
    args = ap.parse_args()
    config = Path(tempfile.mkdtemp()) / "models.yaml"
    flags = {}
    it = iter(args.runner_args)
    for flag in it:
        flags[flag.lstrip("-")] = next(it)
    config.write_text(json.dumps({"models": {"bench": {"source": resolve_model(args.model),
                                                        **flags}}}))
    log = tempfile.NamedTemporaryFile("w+b", prefix="gateway-", suffix=".log", delete=False)
    proc, url = start_server(["--models", str(config)], log)
    try:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"model": "bench", "prompt": "Hello",
                                                      "max_tokens": 1}, timeout=300)
        cold = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        runner = httpx.get(url + "/models").json()["data"][0]["url"]
        rows: dict[str, list[dict]] = {"runner": [], "gateway": []}
        for i in range(args.rounds):
            rows["runner"].append(bench(runner, "bench", args, seed=100 + 2 * i))
            rows["gateway"].append(bench(url, "bench", args, seed=101 + 2 * i))
        gateway_rss = proc_stats(proc.pid)["VmRSS"] / 1024
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[side])

    print(f"{args.rounds} rounds, {args.num_requests} requests, {args.concurrency} streams, "
          f"{args.output_len} tokens each; runner flags: {' '.join(args.runner_args) or '-'}")
    for key, label in (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
                       ("median_itl_ms", "ITL p50 ms")):
        a, b = med("runner", key), med("gateway", key)
        print(f"{label:14} direct {a:9.2f}   gateway {b:9.2f}   gateway/direct {b / a:.3f}")
    print(f"cold start (unloaded model -> first token): {cold:.2f} s")
    print(f"gateway RSS: {gateway_rss:.0f} MiB")


if __name__ == "__main__":
    main()
