"""justllm against llama-server, fresh servers taking turns, several rounds: medians and ratios.

Not a test. On a small machine the two servers cannot run side by side (each takes every core),
and its speed drifts by 10-25% within minutes, so one run of each says little. Each round
starts a fresh ``justllm serve`` and a fresh ``llama-server`` (the order alternating from round
to round) on a free loopback port, warms each with a few short requests, runs the same
``justllm bench`` workload against it (``--seed`` fixes the prompts) and stops it. Printed: each
round's output tok/s, median TTFT and TPOT for both and their ratio, then the medians.

    .venv/bin/python benchmarks/vs_llama_server.py --llama-server PATH [--rounds 4]
        [--streams 8] [--requests 32] [--input-len 64] [--output-len 48]
        [--temperature 0.8] [--top-p 0.95] [--top-k 40] [--min-p 0.05]
        [--justllm-args "..."] [--llama-args "..."]
        [--json FILE] [MODEL]

``--llama-server`` (or ``LLAMA_SERVER``) is a llama-server binary, best built from the llama.cpp
that the pinned llama-cpp-python vendors (README, Performance), run with ``-np STREAMS -t
CORES -c 8192`` plus ``--llama-args``, and ``--no-repack`` where justllm leaves repacked
weights off (llama.cpp built with AMX, which crashes on some Xeons; see ``--repack``), so that
both run the same kernels. For long prompts give llama-server a larger ``-c`` (each slot gets ``c /
streams`` tokens) through ``--llama-args``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from justllm.bench.local_server import LocalServer
from justllm.errors import JustLLMError

FIELDS = (("output_throughput", "tok/s"), ("median_ttft_ms", "TTFT ms"),
          ("median_tpot_ms", "TPOT ms"))


def server_cmd(which: str, args: argparse.Namespace, model: str, port: int) -> list[str]:
    if which == "justllm":
        return [sys.executable, "-m", "justllm", "serve", model, "--port", str(port),
                "--max-seqs", str(args.streams), *shlex.split(args.justllm_args)]
    threads = str(len(os.sched_getaffinity(0)))
    return [args.llama_server, "-m", model, "--port", str(port), "-np", str(args.streams),
            "-t", threads, "-c", "8192", *same_weights(), *shlex.split(args.llama_args)]


def same_weights() -> list[str]:
    """llama-server's ``--no-repack`` where justllm's ``--repack auto`` leaves the weights in
    their plain layouts (a build with AMX), so that both run the same kernels: elsewhere both
    repack (an AVX2 CPU: llama-server with ``--no-repack`` there ran other matmuls)."""
    from justllm.engine.backend import repack_weights

    return [] if repack_weights("auto") else ["--no-repack"]


def bench(url: str, args: argparse.Namespace, out: Path | None, n: int, input_len: int,
          output_len: int) -> None:
    cmd = [sys.executable, "-m", "justllm", "bench", "--url", url, "-n", str(n),
           "-c", str(args.streams), "--input-len", str(input_len),
           "--output-len", str(output_len), "--seed", str(args.seed),
           "--temperature", str(args.temperature)]
    if args.top_p is not None:
        cmd += ["--top-p", str(args.top_p)]
    # (unsent, llama-server applies its own top_k 40 and min_p 0.05; justllm applies none)
    if args.top_k is not None:
        cmd += ["--top-k", str(args.top_k)]
    if args.min_p is not None:
        cmd += ["--min-p", str(args.min_p)]
    if out is not None:
        cmd += ["--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def one_round(which: str, args: argparse.Namespace, model: str, workdir: Path,
              label: str) -> dict[str, float]:
    with (workdir / f"{label}.log").open("w+b") as log:
        try:
            server = LocalServer.launch(lambda port: server_cmd(which, args, model, port),
                                        log=log)
        except JustLLMError as e:
            raise SystemExit(f"{which}: {e}") from None
        try:
            bench(server.url, args, None, 4, 16, 8)  # warm-up: first graphs, caches
            out = workdir / f"{label}.json"
            bench(server.url, args, out, args.requests, args.input_len, args.output_len)
            result = json.loads(out.read_text())
            if result.get("failed"):
                raise SystemExit(f"{which}: {result['failed']} requests failed: "
                                 f"{result.get('first_error')}")
            return {key: float(result[key]) for key, _ in FIELDS}
        finally:
            server.stop()  # (SIGTERM, then a kill after 60 s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="GGUF file (default: the demo model)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, help="sent with every request (default: not sent)")
    ap.add_argument("--min-p", type=float, help="sent with every request (default: not sent)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--justllm-args", default="")
    ap.add_argument("--llama-args", default="")
    ap.add_argument("--json", help="also write every round's figures here")
    args = ap.parse_args()
    if not args.llama_server:
        raise SystemExit("give --llama-server PATH (or LLAMA_SERVER)")
    if args.model:
        model = args.model
    else:
        from justllm.models.source import demo_model_path
        model = str(demo_model_path())

    rows: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="vs-llama-server-") as tmp:
        for r in range(args.rounds):
            order = ("justllm", "llama-server") if r % 2 == 0 else ("llama-server", "justllm")
            row = {which: one_round(which, args, model, Path(tmp), f"{which}-{r}")
                   for which in order}
            rows.append(row)
            j, ls = row["justllm"], row["llama-server"]
            print(f"round {r + 1}: " + "; ".join(
                f"{name} {j[key]:.1f} vs {ls[key]:.1f} ({j[key] / ls[key]:.2f}x)"
                for key, name in FIELDS), flush=True)
    print(f"medians of {args.rounds} rounds (justllm vs llama-server, ratio of medians; "
          "median of the rounds' ratios):")
    for key, name in FIELDS:
        j = statistics.median(row["justllm"][key] for row in rows)
        ls = statistics.median(row["llama-server"][key] for row in rows)
        ratio = statistics.median(row["justllm"][key] / row["llama-server"][key]
                                  for row in rows)
        print(f"  {name:8s} {j:9.1f} {ls:9.1f}  {j / ls:.2f}x  {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
