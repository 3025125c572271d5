"""One step's decodes and a prompt chunk: one ``llama_decode``, or the decodes in one of their own.

Not a test. ``SEQS`` sequences hold ``CONTEXT`` tokens each and decode one token each, beside a
``CHUNK``-token prompt chunk of a new sequence; the step is timed as the engine's backend runs
it with and without ``split`` (core/scheduler.py ``split_decodes_at``), alternately, and each
part alone for reference. Medians of ``--rounds``.

    .venv/bin/python benchmarks/split_decodes.py [--seqs 8] [--context 900] [--chunk 504]

Why it pays on a CPU: llama.cpp's flash attention takes a batch of 64 tokens or more in tiles of
64 queries and skips a tile of the KV only where the mask hides every cell of it from all 64;
one decode row per sequence in such a tile sees every sequence's cells, so the whole KV is
computed for it. A batch of fewer than 64 takes the per-query path, which skips each hidden
cell on its own.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    from justllm.engine.backend import BackendConfig, LlamaBackend
    from justllm.models.source import demo_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--context", type=int, default=900)
    ap.add_argument("--chunk", type=int, default=504)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n_ctx = max(4096, (args.seqs * (args.context + 1) + args.chunk + 255) // 256 * 256)
    b = LlamaBackend(BackendConfig(model_path=str(args.model or demo_model_path()),
                                   n_ctx=n_ctx, n_batch=max(512, args.chunk + args.seqs),
                                   n_seq_max=args.seqs + 1, n_outputs_max=args.seqs + 1))
    rng = np.random.default_rng(0)
    new = args.seqs  # the prompt chunk's sequence

    def put(items: list[tuple[int, int, int, bool]]) -> int:
        for i, (token, pos, seq, out) in enumerate(items):
            b.batch_tokens[i], b.batch_pos[i], b.batch_seq[i] = token, pos, seq
            b.batch_n_seq[i], b.batch_logits[i] = 1, out
        return len(items)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(1000, min(b.n_vocab, 200000), n)]

    for seq in range(args.seqs):
        prompt = tokens(args.context)
        for c0 in range(0, args.context, 512):
            c1 = min(args.context, c0 + 512)
            b.decode(put([(prompt[p], p, seq, p == c1 - 1) for p in range(c0, c1)]))
    decodes = [(t, args.context, s, True) for s, t in enumerate(tokens(args.seqs))]
    chunk = [(t, p, new, p == args.chunk - 1) for p, t in enumerate(tokens(args.chunk))]

    def undo() -> None:
        b.seq_rm(new)
        for seq in range(args.seqs):
            b.seq_rm(seq, args.context)

    ways = {
        "one llama_decode": lambda: b.decode(put(decodes + chunk)),
        "decodes apart (split)": lambda: b.decode(put(decodes + chunk), len(decodes)),
        "the decodes alone": lambda: b.decode(put(decodes)),
        "the chunk alone": lambda: b.decode(put(chunk)),
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.rounds):
        for name, run in ways.items():
            undo()
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    undo()
    b.close()
    print(f"{args.seqs} sequences at {args.context} tokens decoding beside a {args.chunk}-token "
          f"prompt chunk (medians of {args.rounds}):")
    for name, ts in times.items():
        print(f"  {name:24s} {statistics.median(ts) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
