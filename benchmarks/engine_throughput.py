"""Aggregate decode throughput of the engine at 1..32 concurrent sequences.

Not a test: prints tok/s per concurrency and the share of each step spent outside llama_decode
(Python: scheduling, batch filling, sampling, detokenizing). Prefill is excluded: timing starts
once every sequence has its first token. ``--temperature``/``--top-p``/``--top-k``/``--min-p``
sample instead of greedy (the per-token sampling cost shows as a larger Python share); ``--raw`` also times bare batched
``llama_decode`` calls at the same shapes (one token per sequence, argmax), the limit the engine
can approach, twice: reading every row's logits and taking the argmax in numpy (as the engine
does), and with the argmax taken inside the graph (llama.cpp's backend sampling: no logits
leave the device), and a third time with the whole draw in the graph (temperature 0.8, top_p
0.95: the `sampled` column, to set against the engine's sampled tok/s). On a GPU the gap
between the first two is what reading whole 262k-wide rows back costs, and the third is what
choosing sampled tokens on the device with llama.cpp's samplers reaches.
``--raw-candidates`` times bare ``llama_decode`` with the 1024 most likely tokens and their
probabilities under the whole row's softmax taken in the graph instead (engine/backend.py's
own graph sampler; `cand.`: from the whole row, `sliced`: the 64 best of each 1024-wide slice
first) and the 0.95 nucleus drawn from them on the host (each with `inside`: the share of
draws whose nucleus lay within the candidates, where such a draw is exact): what an exact
pre-selection on the device reaches. ``--vs-greedy`` runs greedy and sampled rounds alternately in one engine
(``--rounds`` of each) and reports the medians and their ratio: this machine's speed drifts by
10-15% over a minute, more than the difference sampling makes, so only interleaved rounds
compare the two. ``--backend-sampling`` runs the engine with its flag of that name (the
requests unseeded, so the graph chooses every token).

``--prefill N`` also times the prefill of one N-token prompt (tok/s), which is what
``--n-batch``, ``--n-ubatch`` and ``--flash-attn`` (the llama.cpp context knobs a GPU is tuned
by) change most; the GPUs llama.cpp sees are printed first.

    .venv/bin/python benchmarks/engine_throughput.py [MODEL] [--tokens 64] [--levels 1,4,8,16,32]
        [--temperature 0.8] [--top-p 0.95] [--top-k 40] [--min-p 0.05] [--vs-greedy]
        [--rounds 5] [--raw] [--raw-candidates] [--gpu] [--backend-sampling] [--n-batch 0] [--n-ubatch 0] [--flash-attn auto|on|off] [--prefill 2048]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.backend import gpu_devices
from justllm.engine.engine import Engine
from justllm.engine.graph_sampling import CANDIDATES
from justllm.engine.sampler import RequestSampler

RAW_SAMPLED = (0.8, 0.95)  # temperature, top_p of --raw's draw in the graph
# --raw-candidates takes as many candidates as the engine's --backend-sampling does
# (graph_sampling.CANDIDATES), once from the whole row and once from slices this wide: both
# are timed whatever graph_sampling.CANDIDATE_SLICE is set to, since the GPU check decides it
RAW_SLICE = 1024


def time_sampling(engine: Engine) -> None:
    """Count the seconds the engine spends choosing tokens (``engine.sampling_seconds``): its
    pooled rows and its one-by-one rows, detokenizing and stop checks included (they cost the
    same greedy or sampled, so the difference between the two is the sampling)."""
    engine.sampling_seconds = 0.0  # type: ignore[attr-defined]
    for name in ("_presample", "_sample_one"):
        inner = getattr(engine, name)

        def timed(*args, _inner=inner, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                engine.sampling_seconds += time.perf_counter() - t0  # type: ignore[attr-defined]
        setattr(engine, name, timed)


def measure(engine: Engine, n: int, tokens: int,
            sampling: dict | None = None) -> tuple[float, float, float]:
    """tok/s, Python's share of the wall time and seconds per step of ``n`` sequences of
    ``tokens`` tokens each; ``sampling``: SamplingParams fields (none: greedy)."""
    # (a seeded request is sampled on the host: with --backend-sampling the graph draws them)
    seed = None if engine.config.backend_sampling else 1
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True, seed=seed,
                            **(sampling or {}))
    ids = [engine.add_request(f"Request {i}: write a long story about the sea.", params)
           for i in range(n)]
    started: set[str] = set()
    while len(started) < n:  # prefill and first tokens
        started |= {o.request_id for o in engine.step()}
    t0 = time.perf_counter()
    d0 = engine.backend.decode_seconds
    s0 = engine.sampling_seconds  # type: ignore[attr-defined]
    pooled = engine.row_sampler
    p0, w0 = pooled.prepare_seconds, pooled.draw_seconds
    steps = produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
        steps += 1
    wall = time.perf_counter() - t0
    in_llama = engine.backend.decode_seconds - d0
    assert all(i not in engine._live for i in ids)
    engine.last_sampling_per_step = (engine.sampling_seconds - s0) / steps  # type: ignore
    # of which the pooled rows' passes over the vocabulary and their draws (row_sampling.py)
    engine.last_split_per_step = ((pooled.prepare_seconds - p0) / steps,  # type: ignore
                                  (pooled.draw_seconds - w0) / steps)
    return produced / wall, (wall - in_llama) / wall, wall / steps


def decode_prompt(engine: Engine, seq: int, tokens: list[int], start: int):
    """One bare llama_decode of ``tokens`` at positions ``start``... in sequence ``seq``, the
    last token's logits asked for (and returned)."""
    b = engine.backend
    m = len(tokens)
    b.batch_tokens[:m], b.batch_pos[:m] = tokens, range(start, start + m)
    b.batch_seq[:m], b.batch_n_seq[:m], b.batch_logits[:m] = seq, 1, 0
    b.batch_logits[m - 1] = 1
    return b.decode(m)


def raw_decode(engine: Engine, n: int, tokens: int, in_graph: bool = False,
               temperature: float = 0.0, top_p: float = 1.0,
               candidates: int = 0, segment: int = 0) -> tuple[float, float]:
    """tok/s of bare batched llama_decode: ``n`` sequences of an 8-token prompt, then
    ``tokens`` steps of one token each (argmax), every row's logits read (``in_graph``: the
    token chosen inside the graph instead, so no logits leave the device: the argmax, or with
    ``temperature`` a draw from the ``top_p`` nucleus; with ``candidates``, that many
    candidates with their probabilities (picked from ``segment``-wide slices first, if
    given), and the host's draw from their nucleus). One more step before the clock starts
    warms up (in the graph: llama.cpp reserves its graphs again). The engine must be idle; its
    prefix cache is flushed and the KV cleared before and after. Returns tok/s and the share
    of candidate draws whose nucleus lay within the candidates."""
    b = engine.backend
    engine.flush_prefix_cache()  # its holders keep KV: gone, so clearing desyncs nothing
    b.clear_kv()
    prompt = b.tokenize("Write a long story about the sea.")[:8]
    m = len(prompt)
    for s in range(n):
        last = int(decode_prompt(engine, s, prompt, 0)[0].argmax())
    nxt = [last] * n
    if in_graph:
        b.set_tokens_in_graph(range(n), temperature, top_p, seed=1, candidates=candidates,
                              segment=segment)
    # each sequence's draws from the candidates, as the engine's own (RequestSampler)
    drawers = [RequestSampler(SamplingParams(temperature=temperature, top_p=top_p), 1 + s)
               for s in range(n)]
    inside, drawn = 0, 0
    try:
        t0 = time.perf_counter()
        for step in range(tokens + 1):
            if step == 1:
                t0 = time.perf_counter()
            b.batch_tokens[:n], b.batch_pos[:n] = nxt, m + step
            b.batch_seq[:n], b.batch_n_seq[:n], b.batch_logits[:n] = range(n), 1, 1
            if in_graph and candidates:
                b.decode(n)
                nxt = []
                for i in range(n):
                    ids, probs, bound = b.graph_candidates(i)
                    token = drawers[i].draw_candidates(ids, probs, bound)
                    # (undecided: the engine would compute the row again; here the best goes on)
                    nxt.append(int(ids[probs.argmax()]) if token is None else token)
                    inside, drawn = inside + (token is not None), drawn + 1
            elif in_graph:
                b.decode(n)
                nxt = b.graph_tokens(n)
            else:
                nxt = b.decode(n).argmax(axis=1).tolist()
        rate = n * tokens / (time.perf_counter() - t0)
    finally:
        b.set_tokens_in_graph([])
        b.clear_kv()
    return rate, inside / drawn if drawn else 1.0


def raw_candidates(engine: Engine, levels: list[int], tokens: int) -> list[dict]:
    """--raw-candidates: bare llama_decode with the top candidates and their probabilities
    taken in the graph by engine/backend.py's own sampler, from the whole row and from slices
    first, and the nucleus drawn from them on the host: what an exact pre-selection on the
    device reaches (against --raw's columns). A run of its own, since the sampler builds its
    graph nodes through ctypes and has not yet run on every device."""
    print(f"{'seqs':>5} {'cand.':>8} {'inside':>7} {'sliced':>8} {'inside':>7}")
    rows = []
    for n in levels:
        row: dict = {"seqs": n}
        line = f"{n:>5}"
        for name, segment in (("candidates", 0), ("sliced", RAW_SLICE)):
            got, held = raw_decode(engine, n, tokens, in_graph=True,
                                   temperature=RAW_SAMPLED[0], top_p=RAW_SAMPLED[1],
                                   candidates=CANDIDATES, segment=segment)
            row[f"raw_{name}_tok_s"], row[f"raw_{name}_nucleus_inside"] = got, held
            line += f" {got:>8.1f} {100 * held:>6.1f}%"
        rows.append(row)
        print(line, flush=True)
    return rows


def sampling_of(args: argparse.Namespace) -> dict:
    order = {"samplers": ("top_k", "top_p", "min_p", "temperature")} if args.llama_order else {}
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "min_p": args.min_p, **order}


def vs_greedy(engine: Engine, levels: list[int], args: argparse.Namespace) -> list[dict]:
    """Greedy and sampled rounds in turn at each level; medians, their ratio, and the extra
    milliseconds a step spends when it samples (the per-step sampling time)."""
    print(f"{'seqs':>5} {'greedy':>8} {'sampled':>8} {'ratio':>6} {'ms/step':>8} {'+ms':>6} "
          f"{'choose ms':>9} {'prepare':>7} {'draw':>6} {'greedy':>7}")
    rows = []
    for n in levels:
        greedy, sampled = [], []
        g_choose, s_choose, s_split = [], [], []
        for _ in range(args.rounds):
            greedy.append(measure(engine, n, args.tokens))
            g_choose.append(engine.last_sampling_per_step)  # type: ignore[attr-defined]
            sampled.append(measure(engine, n, args.tokens, sampling_of(args)))
            s_choose.append(engine.last_sampling_per_step)  # type: ignore[attr-defined]
            s_split.append(engine.last_split_per_step)  # type: ignore[attr-defined]
        prep = statistics.median(p for p, _ in s_split)
        draw = statistics.median(d for _, d in s_split)
        g = statistics.median(r[0] for r in greedy)
        s = statistics.median(r[0] for r in sampled)
        g_step = statistics.median(r[2] for r in greedy)
        s_step = statistics.median(r[2] for r in sampled)
        ratios = [b[0] / a[0] for a, b in zip(greedy, sampled)]
        rows.append({"seqs": n, "greedy_tok_s": g, "sampled_tok_s": s,
                     "ratio": statistics.median(ratios), "ratios": ratios,
                     "greedy_ms_per_step": 1000 * g_step, "sampled_ms_per_step": 1000 * s_step,
                     "choose_ms_per_step": 1000 * statistics.median(s_choose),
                     "prepare_ms_per_step": 1000 * prep, "draw_ms_per_step": 1000 * draw,
                     "greedy_choose_ms_per_step": 1000 * statistics.median(g_choose)})
        print(f"{n:>5} {g:>8.1f} {s:>8.1f} {statistics.median(ratios):>6.3f} "
              f"{1000 * s_step:>8.1f} {1000 * (s_step - g_step):>6.1f} "
              f"{1000 * statistics.median(s_choose):>9.2f} {1000 * prep:>7.2f} {1000 * draw:>6.2f} "
              f"{1000 * statistics.median(g_choose):>7.2f}")
    return rows


def prefill(engine: Engine, n: int) -> float:
    """tok/s of one ``n``-token prompt's prefill, in ``n_batch``-sized decodes (the engine must
    be idle; the KV is cleared before and after)."""
    b = engine.backend
    engine.flush_prefix_cache()
    b.clear_kv()
    words = b.tokenize("Write a long story about the sea and the ships that sail on it. ")
    tokens = (words * (n // len(words) + 1))[:n]
    step = engine.config.n_batch
    t0 = time.perf_counter()
    for start in range(0, n, step):
        decode_prompt(engine, 0, tokens[start:start + step], start)
    rate = n / (time.perf_counter() - t0)
    b.clear_kv()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,4,8,16,32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0: off")
    ap.add_argument("--min-p", type=float, default=0.0, help="0: off")
    ap.add_argument("--llama-order", action="store_true",
                    help="sample in llama.cpp's order, as /completion does (cuts, then the "
                         "temperature)")
    ap.add_argument("--vs-greedy", action="store_true",
                    help="alternate greedy and sampled rounds; report medians and the ratio")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each with --vs-greedy")
    ap.add_argument("--raw", action="store_true", help="also time bare llama_decode (the limit)")
    ap.add_argument("--raw-candidates", action="store_true",
                    help="only time bare llama_decode with the top 1024 candidates and their "
                         "probabilities taken in the graph (from the whole row, and from "
                         "1024-wide slices first), the nucleus drawn on the host")
    ap.add_argument("--gpu", action="store_true", help="offload every layer (a GPU build)")
    ap.add_argument("--n-batch", type=int, default=0,
                    help="tokens per step (llama.cpp n_batch); 0: the device's default")
    ap.add_argument("--n-ubatch", type=int, default=0,
                    help="llama.cpp's micro-batch; 0: the device's default")
    ap.add_argument("--flash-attn", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--backend-sampling", action="store_true",
                    help="the engine's --backend-sampling: tokens chosen in the graph")
    ap.add_argument("--prefill", type=int, default=0, help="also time one prompt this long")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    gpus = gpu_devices()
    for g in gpus:
        print(f"GPU: {g.name}, {g.free_bytes / 2**30:.1f} of {g.total_bytes / 2**30:.1f} GiB free")
    levels = [int(x) for x in args.levels.split(",")]
    seqs = max(32, *levels)
    engine = Engine(EngineConfig(model=args.model, max_seqs=seqs, max_decode=seqs,
                                 pool_blocks=max(1024, seqs * (args.tokens + 32) // 16 + 64,
                                                 args.prefill // 16 + 16),
                                 threads=args.threads, gpu=args.gpu or EngineConfig().gpu,
                                 n_batch=args.n_batch, n_ubatch=args.n_ubatch,
                                 flash_attn=args.flash_attn,
                                 backend_sampling=args.backend_sampling))
    time_sampling(engine)
    measure(engine, 2, 4)  # warm-up
    settings = {"n_batch": engine.config.n_batch, "n_ubatch": engine.backend.n_ubatch,
                "backend_sampling": args.backend_sampling,
                "chunk_size": engine.config.chunk_size,
                "flash_attn": args.flash_attn, "gpus": [g.__dict__ for g in gpus]}
    if args.prefill:
        settings["prefill_tokens"] = args.prefill
        settings["prefill_tok_s"] = rate = prefill(engine, args.prefill)
        print(f"prefill of {args.prefill} tokens (n_batch {engine.config.n_batch}, n_ubatch "
              f"{engine.backend.n_ubatch}, flash attention {args.flash_attn}): {rate:.0f} tok/s")
    if args.vs_greedy:
        rows = vs_greedy(engine, levels, args)
        engine.close()
        write_json(args, engine, settings, rows, rounds=args.rounds)
        return
    if args.raw_candidates:
        rows = raw_candidates(engine, levels, args.tokens)
        engine.close()
        write_json(args, engine, settings, rows)
        return
    print(f"{'seqs':>5} {'tok/s':>8} {'python %':>9} {'ms/step':>8}"
          + (f" {'raw tok/s':>10} {'of raw':>7} {'in-graph':>9} {'sampled':>8}"
             if args.raw else ""))
    rows = []
    for n in levels:
        rate, py_share, step = measure(engine, n, args.tokens, sampling_of(args))
        row = {"seqs": n, "tok_s": rate, "python_share": py_share, "ms_per_step": 1000 * step}
        line = f"{n:>5} {rate:>8.1f} {100 * py_share:>8.1f}% {1000 * step:>8.1f}"
        if args.raw:
            row["raw_tok_s"] = raw = raw_decode(engine, n, args.tokens)[0]
            row["raw_in_graph_tok_s"] = graph = raw_decode(engine, n, args.tokens,
                                                           in_graph=True)[0]
            # the whole draw in the graph too: what choosing sampled tokens on the device
            # would reach (against the engine's sampled tok/s of --vs-greedy)
            row["raw_in_graph_sampled_tok_s"] = drawn = raw_decode(
                engine, n, args.tokens, in_graph=True, temperature=RAW_SAMPLED[0],
                top_p=RAW_SAMPLED[1])[0]
            line += f" {raw:>10.1f} {100 * rate / raw:>6.1f}% {graph:>9.1f} {drawn:>8.1f}"
        rows.append(row)
        print(line)
    engine.close()
    write_json(args, engine, settings, rows)


def write_json(args: argparse.Namespace, engine: Engine, settings: dict, rows: list[dict],
               **extra: object) -> None:
    """The run's settings, sampling and rows to ``--json``'s file, when given."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": engine.config.gpu, **settings, "tokens": args.tokens, **extra,
                       **sampling_of(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
