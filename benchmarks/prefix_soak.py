"""Prefix-cache soak: issue #21's traffic against one server for minutes, counting failures
and leaks.

Not a test (the suite's bounded versions are tests/engine/test_kv_stress.py and
tests/server/test_soak.py). The workload is justllm/bench/soak.py: ``--clients`` clients
sending completions one after another, prompts from a 20-word vocabulary, 60% streaming, a
share of clients disconnecting early. Loopback only.

    python benchmarks/prefix_soak.py --minutes 15                       # starts `justllm serve`
    python benchmarks/prefix_soak.py --minutes 15 -- --pool-blocks 256  # extra serve flags
    python benchmarks/prefix_soak.py --url http://127.0.0.1:8080        # a running server

Prints requests, HTTP 5xx (and error events inside 200 streams), disconnects, the llama.cpp
errors in the server's log, and, once idle, KV blocks in use beyond what the prefix cache holds
(anything but 0 is a leak).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from justllm.bench.soak import SoakConfig, idle_leak, soak


def start_server(extra: list[str], log) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "justllm", "serve", "--port", str(port),
                             *extra], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running server (else one is started)")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--disconnect", type=float, default=0.2,
                    help="share of requests whose client leaves early")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_args", nargs="*", help="flags for `justllm serve` (after --)")
    args = ap.parse_args()
    cfg = SoakConfig(clients=args.clients, seconds=args.minutes * 60,
                     disconnect=args.disconnect, seed=args.seed)
    proc = None
    log = tempfile.NamedTemporaryFile("w+b", prefix="soak-server-", suffix=".log", delete=False)
    url = args.url
    if url is None:
        proc, url = start_server(args.serve_args, log)
    try:
        t0 = time.monotonic()
        counts = asyncio.run(soak(url, cfg))
        used, cached = asyncio.run(idle_leak(url))
        elapsed = time.monotonic() - t0
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    server_log = open(log.name, "rb").read().decode("utf-8", "replace")
    print(f"{elapsed / 60:.1f} min, {args.clients} clients, serve flags: "
          f"{' '.join(args.serve_args) or '(defaults)'}")
    print("requests", counts["requests"], "ok", counts["ok"], "5xx", counts["5xx"],
          "disconnected", counts["disconnected"],
          "other", {k: v for k, v in counts.items()
                    if k not in ("requests", "ok", "5xx", "disconnected")})
    if proc is not None:
        print("llama.cpp 'inconsistent sequence positions':",
              server_log.count("inconsistent sequence positions"),
              "| 'failed to decode':", server_log.count("failed to decode"),
              "| server log:", log.name)
    print(f"idle: {used:.0f} KV blocks in use, {cached:.0f} held by the prefix cache, "
          f"leak {used - cached:.0f}")


if __name__ == "__main__":
    main()
