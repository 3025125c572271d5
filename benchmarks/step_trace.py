"""Every ``llama_decode`` of a running server, timed: where a serving workload's time goes.

Not a test. ``serve`` runs ``justllm serve ARGS...`` with each decode call written to FILE as
one line: its start (``time.perf_counter``), the batch's tokens, its logits rows and the seconds
it took. ``summary`` reads such a file: per batch shape (tokens, rows), how many and how long
(median, 90th percentile, total), and the time between calls (Python: choosing tokens,
scheduling, streaming). Load it meanwhile with ``justllm bench --url ...``.

This found why justllm's TPOT trailed llama-server's with short outputs: a wave of new prompts
went into three steps (at most 4 prompts a step, ``--max-prefill``) where llama-server takes
them in one, while its 8-row decode steps cost the same as llama-server's.

    .venv/bin/python benchmarks/step_trace.py serve FILE MODEL [serve flags...]
    .venv/bin/python benchmarks/step_trace.py summary FILE
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import TextIO


def serve(trace: Path, args: list[str]) -> None:
    import numpy as np

    from justllm.cli import main
    from justllm.engine.backend import LlamaBackend

    out: TextIO = trace.open("w", buffering=1)
    decode = LlamaBackend.decode

    def timed(self: LlamaBackend, n_tokens: int, split: int = 0) -> np.ndarray:
        rows = int(np.count_nonzero(self.batch_logits[:n_tokens]))
        t0 = time.perf_counter()
        logits = decode(self, n_tokens, split)  # (a split step's two llama_decodes as one)
        out.write(f"{t0:.6f} {n_tokens} {rows} {time.perf_counter() - t0:.6f}\n")
        return logits

    LlamaBackend.decode = timed  # type: ignore[method-assign]
    sys.argv = ["justllm", "serve", *args]
    main()


def summary(trace: Path) -> str:
    calls = [(float(start), int(tokens), int(rows), float(seconds))
             for start, tokens, rows, seconds in
             (line.split() for line in trace.read_text().splitlines() if line.strip())]
    if not calls:
        return f"{trace}: no decode calls"
    shapes: dict[tuple[int, int], list[float]] = defaultdict(list)
    for _, tokens, rows, seconds in calls:
        shapes[tokens, rows].append(seconds * 1000)
    lines = [f"{'tokens':>6} {'rows':>5} {'calls':>6} {'median ms':>10} {'p90 ms':>8} {'total s':>8}"]
    for (tokens, rows), ms in sorted(shapes.items(), key=lambda kv: -sum(kv[1])):
        p90 = statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else ms[0]
        lines.append(f"{tokens:>6} {rows:>5} {len(ms):>6} {statistics.median(ms):>10.1f} "
                     f"{p90:>8.1f} {sum(ms) / 1000:>8.2f}")
    gaps = [(start - (prev + took)) * 1000  # (a pause over 1 s is idle, not a gap)
            for (prev, _, _, took), (start, _, _, _) in zip(calls, calls[1:])
            if start - (prev + took) < 1.0]
    decoding = sum(seconds for *_, seconds in calls)
    lines.append(f"{len(calls)} calls, {decoding:.2f} s in llama_decode; between calls "
                 f"(under 1 s): median {statistics.median(gaps) if gaps else 0:.2f} ms, "
                 f"total {sum(gaps) / 1000:.2f} s")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "summary":
        print(summary(Path(sys.argv[2])))
    elif len(sys.argv) >= 4 and sys.argv[1] == "serve":
        serve(Path(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit(__doc__.split("\n\n")[-1].rstrip())


if __name__ == "__main__":
    main()
