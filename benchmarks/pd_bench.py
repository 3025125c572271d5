"""Prefill/decode disaggregation in the case it exists for: ``--streams`` streams decoding while
long prompts (``--min-tokens``..``--max-tokens`` tokens) arrive every ``--interval`` seconds.
Measures the decoding streams' inter-token latency (ITL) and the long prompts' time to first
token (TTFT) for each mode, plus, for PD, what the KV transfer costs. Not a test. Loopback
only; starts and stops its own servers, and leaves none behind (on error or Ctrl-C too).

    python benchmarks/pd_bench.py                                  # both modes, demo model
    python benchmarks/pd_bench.py --modes pd --duration 10 --json out.json
    python benchmarks/pd_bench.py --interval 2 --min-tokens 500 --max-tokens 1000

Modes (each on a fresh server, so no prefix cache carries over):

* ``single``: one ``justllm serve MODEL --threads 2 --max-seqs 12`` (``--single-threads``),
  chunked prefill with serve's defaults (or ``--chunk-size`` / ``--n-batch`` here, which go
  to both modes): the long prompts' prefill chunks share engine steps with the streams'
  decode.
* ``pd``: a ``justllm serve --models`` gateway with the model as ``prefill-replicas: 1`` and
  ``decode-replicas: 1``, ``threads: 1`` each (``--pd-threads``): every completion is computed
  by the prefill runner, its KV sent (through the gateway) to the decode runner, which imports
  it and generates. Every request goes this way, the streams' short prompts too.

One run: ``--streams`` streaming greedy completions (short distinct prompts, ``ignore_eos``,
``--stream-tokens`` tokens; a stream whose completion ends starts another, so all of them
decode for the whole run) start; once each has its first token, ``--baseline`` quiet seconds
(no long prompts: the ITL of the mode on its own), then long prompts are sent every
``--interval`` s for ``--duration`` s (distinct seeded random-word texts, no shared prefixes,
``max_tokens`` 4, streaming). The load window runs from the first long prompt until the last
one has its first token (at most ``--drain`` s after the last was sent; those still waiting
then are cancelled and counted as not done, their TTFT as at least their wait so far, shown
with '>'). Then the streams stop; once the runners hold no request (``--idle-timeout``),
``--quiet`` more long prompts (of the mean size) are sent one at a time with nothing else
running: a long prompt's TTFT on an idle server, and for PD the cost of one transfer without
contention.

All times are measured here, client side: ITL is the gap between successive chunks with
text of one completion (its first chunk left out), put in the window its later chunk falls
in; TTFT is from sending to the first chunk with text. The KV transfer numbers come from
the runners' ``justllm_pd_transfer_seconds`` (export: the prefill runner gathering and
serialising the KV; import: the decode runner checking and loading it; both run on the
engine thread between steps, and the runner's clock starts before waiting for it, so under
load they include waiting for the step in progress) and ``justllm_pd_bytes_total`` as relayed
by the gateway's /metrics, and from the gateway's /models ``pd`` row (``prefill_seconds``: from
sending a prompt to the prefill runner until holding its KV, so queueing and prefill
included). Per 1,000 tokens: each counter's mean per transfer over the mean prompt size of the
requests sent and answered in the window (tokenised here, with the model's own tokenizer);
over the load window these include the streams' own short prompts, the quiet row is long
prompts alone.

Caveats: the client (and, for PD, the gateway) run on the same cores as the runners; with
2 cores, (a) gives the one engine both, (b) gives each runner one, so PD's decode has half the
compute of single's even when no prompt arrives (compare the quiet ITL rows). Anything else
using these cores skews the result badly (llama.cpp's threads wait for each other, so a
2-thread engine sharing one core with another process slows to a crawl): each mode first
waits for the machine to be idle (``--wait-idle``), and the table shows, per window, the cores
used by the server(s), this client and everything else (read from /proc).
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
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from justllm.gateway.runner import free_port
from justllm.models.source import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing_bench import alive, reap  # noqa: E402  (the other gateway benchmark's helpers)

NAME = "demo"
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
STORY = ["Once upon a time", "In a small town", "The old sailor said", "Long ago, far away",
         "On a cold morning", "The letter began", "Deep in the forest", "At the market",
         "The engineer wrote", "Every summer", "Under the bridge", "The teacher asked"]


# ---- the workload -----------------------------------------------------------------------------


def tokenizer(model_path: str):
    """A token counter with the model's own tokenizer (vocab only: no weights loaded)."""
    from llama_cpp import Llama

    vocab = Llama(model_path=model_path, vocab_only=True, verbose=False)
    return lambda text: len(vocab.tokenize(text.encode(), add_bos=True, special=False))


def long_prompt(tag: str, seed: int, tokens: int, n_tokens) -> str:
    """Seeded random-word text of ``tokens`` tokens (or a few fewer), starting with its own
    tag and random words, so no two share a prefix block."""
    rng = random.Random(seed)
    words = [f"Report {tag}:"]
    while True:  # a few tokens per word: overshoot, then trim
        words += [rng.choice(WORDS) + ("." if rng.random() < 0.1 else "")
                  for _ in range(max(16, (tokens - n_tokens(" ".join(words))) // 2))]
        if n_tokens(" ".join(words)) >= tokens:
            break
    lo, hi = 1, len(words)  # the most words within ``tokens`` tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if n_tokens(" ".join(words[:mid])) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def stream_prompt(k: int, round_: int) -> str:
    return f"{STORY[k % len(STORY)]} (story {k}, part {round_}),"


# ---- servers ----------------------------------------------------------------------------------


class Server:
    """A ``justllm serve`` (plain, or a gateway) in its own process group; ``stop`` ends it and
    everything it started."""

    def __init__(self, argv: list[str], workdir: Path) -> None:
        self.workdir = workdir
        self.url = f"http://127.0.0.1:{free_port()}"
        self.pids: set[int] = set()  # runners seen (PD), killed by pid if they outlive it
        with (workdir / "server.log").open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "justllm", "serve", *argv, "--port",
                 self.url.rsplit(":", 1)[1]], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "JUSTLLM_CACHE_DIR": str(workdir / "cache")})

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {self.proc.returncode}")

    def log_tail(self, lines: int = 20) -> str:
        texts = [(self.workdir / "server.log").read_text(errors="replace")]
        texts += [p.read_text(errors="replace") for p in sorted(self.workdir.rglob("*.log"))
                  if p.name != "server.log"]
        return "".join("".join(t.splitlines(True)[-lines:]) for t in texts)

    def stop(self, grace: float = 60.0) -> None:
        """SIGTERM (a gateway stops its runners), SIGKILL to the process group on timeout,
        then any runner still alive (same group, or seen by pid) is killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 15
        while any(alive(p) for p in self.pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of its group
        except (ProcessLookupError, PermissionError):
            pass
        reap(self.pids)
        self.proc.wait()


def start_single(args, workdir: Path, box: list) -> Server:
    flags = ["--threads", str(args.single_threads), "--max-seqs", str(args.max_seqs)]
    if args.chunk_size:
        flags += ["--chunk-size", str(args.chunk_size)]
    if args.n_batch:
        flags += ["--n-batch", str(args.n_batch)]
    server = Server([args.model, "--served-model-name", NAME, *flags], workdir)
    box.append(server)
    deadline = time.monotonic() + args.load_timeout
    while time.monotonic() < deadline:
        server.check()
        try:
            if httpx.get(server.url + "/health", timeout=2, trust_env=False).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the server was not ready within {args.load_timeout:.0f} s")


def models_row(url: str) -> dict:
    rows = httpx.get(url + "/models", timeout=10, trust_env=False).json()["data"]
    return next(r for r in rows if r["model"] == NAME)


def start_pd(args, workdir: Path, box: list) -> Server:
    entry = {"source": args.model, "prefill-replicas": 1, "decode-replicas": 1,
             "preload": True, "ttl": -1, "threads": args.pd_threads, "max-seqs": args.max_seqs}
    if args.chunk_size:
        entry["chunk-size"] = args.chunk_size
    if args.n_batch:
        entry["n-batch"] = args.n_batch
    config = workdir / "models.yaml"
    config.write_text(json.dumps({"models": {NAME: entry}}))
    server = Server(["--models", str(config)], workdir)
    box.append(server)
    deadline = time.monotonic() + args.load_timeout
    while time.monotonic() < deadline:
        server.check()
        try:
            row = models_row(server.url)
            server.pids |= {r["pid"] for r in row["replicas"] if r.get("pid")}
            if row["status"] == "failed":
                raise RuntimeError(f"the model failed to load: {row.get('error')}")
            roles = sorted(r["role"] for r in row["replicas"] if r["status"] == "ready")
            if roles == ["decode", "prefill"]:
                return server
        except (httpx.HTTPError, ValueError, KeyError, StopIteration):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the replicas were not ready within {args.load_timeout:.0f} s")


def pd_snapshot(url: str) -> dict:
    """The runners' PD series (summed over replicas) and the gateway's /models pd row."""
    out = {"export_s": 0.0, "export_n": 0.0, "import_s": 0.0, "import_n": 0.0,
           "export_bytes": 0.0, "import_bytes": 0.0, "import_failures": 0.0}
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") != NAME or "replica" not in s.labels:
                continue
            d = s.labels.get("direction")
            if s.name == "justllm_pd_transfer_seconds_sum":
                out[f"{d}_s"] += s.value
            elif s.name == "justllm_pd_transfer_seconds_count":
                out[f"{d}_n"] += s.value
            elif s.name == "justllm_pd_bytes_total":
                out[f"{d}_bytes"] += s.value
            elif s.name == "justllm_pd_import_failures_total":
                out["import_failures"] += s.value
    pd = models_row(url).get("pd") or {}
    out.update(transfers=pd.get("transfers", 0), gateway_bytes=pd.get("bytes", 0),
               prefill_seconds=pd.get("prefill_seconds", 0.0),
               fallbacks=sum((pd.get("fallbacks") or {}).values()),
               fallback_reasons=dict(pd.get("fallbacks") or {}))
    return out


def pd_delta(a: dict, b: dict, tokens: list[int]) -> dict:
    """The PD counters between two snapshots, per transfer and per 1,000 prompt tokens.
    ``tokens``: the prompt sizes of the requests served in between (one transfer each); the
    per-token figures divide each counter's mean per transfer by their mean size, so a few
    transfers still in flight at either end do not skew them."""
    d = {k: b[k] - a[k] for k in a if k != "fallback_reasons"}
    mean_tokens = statistics.mean(tokens) if tokens else None

    def per_k(total: float, n: float) -> float | None:
        return 1e6 * total / n / mean_tokens if n and mean_tokens else None

    return {
        "requests": len(tokens), "prompt_tokens": sum(tokens), "transfers": d["transfers"],
        "exports": int(d["export_n"]), "imports": int(d["import_n"]),
        "import_failures": int(d["import_failures"]), "fallbacks": d["fallbacks"],
        "fallback_reasons": b["fallback_reasons"],
        "export_ms_mean": 1000 * d["export_s"] / d["export_n"] if d["export_n"] else None,
        "import_ms_mean": 1000 * d["import_s"] / d["import_n"] if d["import_n"] else None,
        "export_ms_per_1k": per_k(d["export_s"], d["export_n"]),
        "import_ms_per_1k": per_k(d["import_s"], d["import_n"]),
        "gateway_prefill_ms_per_1k": per_k(d["prefill_seconds"], d["transfers"]),
        "bytes_per_token": (d["gateway_bytes"] / d["transfers"] / mean_tokens
                            if d["transfers"] and mean_tokens else None),
        "import_bytes": d["import_bytes"], "export_bytes": d["export_bytes"],
    }


def busy_requests(url: str) -> float:
    """Requests running or waiting in the runner(s) behind ``url`` (summed over replicas)."""
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))


def cpu_sample(pgid: int) -> tuple[float, float, float, float]:
    """(wall s, all CPUs' busy s, the server group's CPU s, this process's CPU s): what the
    machine did besides us is the difference (other sessions share these cores)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(v[:8]) - v[3] - v[4]) / tick  # all but idle and iowait (guest is in user)
    server = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            server += int(fields[11]) + int(fields[12])
    t = os.times()
    return time.monotonic(), busy, server / tick, t.user + t.system


def wait_idle(limit: float, cores: float = 0.25, span: float = 5.0) -> float | None:
    """Until the machine's CPUs were busy less than ``cores`` on average over ``span`` s (other
    sessions may share them), at most ``limit`` s; the busy cores last seen (None: not
    waited)."""
    if limit <= 0:
        return None
    deadline = time.monotonic() + limit
    while True:
        a = cpu_sample(-1)
        time.sleep(span)
        b = cpu_sample(-1)
        busy = (b[1] - a[1]) / (b[0] - a[0])
        if busy < cores or time.monotonic() >= deadline:
            return round(busy, 2)
        print(f"  the machine is busy ({busy:.2f} cores used by others); waiting",
              file=sys.stderr, flush=True)


def cpu_use(a: tuple, b: tuple) -> dict:
    """Cores used on average between two samples: by the server(s), this client, the rest."""
    wall = b[0] - a[0]
    if wall <= 0:
        return {}
    total, server, client = ((b[i] - a[i]) / wall for i in (1, 2, 3))
    return {"server_cores": round(server, 2), "client_cores": round(client, 2),
            "other_cores": round(max(0.0, total - server - client), 2)}


# ---- one run ----------------------------------------------------------------------------------


async def complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                   rec: dict, t0: float) -> None:
    """One streamed greedy completion; appends each text chunk's time (s since t0) to
    rec["chunks"] as it comes (so a cancelled one keeps what it got)."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    rec["sent"] = time.perf_counter() - t0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error in stream: {chunk['error']}")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                rec["chunks"].append(time.perf_counter() - t0)
    rec["done"] = time.perf_counter() - t0


async def workload(url: str, pgid: int, args, longs: list[str], n_tokens) -> dict:
    t0 = time.perf_counter()
    cpu = {}
    streams: list[dict] = []  # one record per stream completion
    longs_out: list[dict] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=args.streams + len(longs) + 8,
                          max_keepalive_connections=args.streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=30), trust_env=False,
                                 limits=limits) as client:
        async def stream(k: int) -> None:
            round_ = 0
            while True:
                prompt = stream_prompt(k, round_)
                rec = {"stream": k, "round": round_, "chunks": [],
                       "prompt_tokens": n_tokens(prompt)}
                streams.append(rec)
                try:
                    await complete(client, url, prompt, args.stream_tokens, rec, t0)
                except (httpx.HTTPError, RuntimeError) as e:
                    errors.append(f"stream {k}: {type(e).__name__}: {e}")
                    await asyncio.sleep(0.5)
                round_ += 1

        async def long_one(i: int, prompt: str) -> None:
            rec = {"index": i, "chunks": [], "prompt_tokens": n_tokens(prompt)}
            longs_out.append(rec)
            try:
                await complete(client, url, prompt, 4, rec, t0)
            except (httpx.HTTPError, RuntimeError) as e:
                rec["error"] = f"{type(e).__name__}: {e}"
                errors.append(f"long {i}: {rec['error']}")

        tasks = [asyncio.create_task(stream(k)) for k in range(args.streams)]
        try:
            async def all_started() -> None:  # every stream has its first token
                while len({r["stream"] for r in streams if r["chunks"]}) < args.streams:
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(all_started(), timeout=args.load_timeout)
            t_base = time.perf_counter() - t0
            cpu["base"] = cpu_sample(pgid)
            await asyncio.sleep(args.baseline)
            snap0 = pd_snapshot(url) if args.mode == "pd" else None
            t_load = time.perf_counter() - t0
            cpu["load"] = cpu_sample(pgid)
            long_tasks = []
            for i, prompt in enumerate(longs):
                delay = t_load + i * args.interval - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                long_tasks.append(asyncio.create_task(long_one(i, prompt)))
            t_last_sent = time.perf_counter() - t0

            async def first_tokens() -> None:  # until each long prompt has its first token
                while not all(r["chunks"] or "error" in r or "done" in r for r in longs_out):
                    await asyncio.sleep(0.05)

            try:
                await asyncio.wait_for(first_tokens(), timeout=args.drain)
            except TimeoutError:
                pass
            t_end = time.perf_counter() - t0
            cpu["end"] = cpu_sample(pgid)
            snap1 = pd_snapshot(url) if args.mode == "pd" else None
            await asyncio.wait(long_tasks, timeout=10)  # their last 3 tokens
            for t in long_tasks:
                t.cancel()
            await asyncio.gather(*long_tasks, return_exceptions=True)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        # Quiet long prompts, one at a time, nothing else running: first, until the runners
        # have nothing left (the requests cancelled above should leave them at once).
        t_idle = time.perf_counter()
        while (busy := busy_requests(url)) and time.perf_counter() - t_idle < args.idle_timeout:
            await asyncio.sleep(0.2)
        idle_after = time.perf_counter() - t_idle
        if busy:
            errors.append(f"the runners still had {busy:.0f} requests {idle_after:.0f} s after "
                          "the run was cancelled: the quiet rows are not quiet")
        await asyncio.sleep(1.0)
        quiet = []
        size = (args.min_tokens + args.max_tokens) // 2
        qa = pd_snapshot(url) if args.mode == "pd" else None
        for j in range(args.quiet):
            prompt = long_prompt(f"quiet-{j}", args.seed * 7919 + 100_000 + j, size, n_tokens)
            rec = {"index": j, "chunks": [], "prompt_tokens": n_tokens(prompt)}
            try:
                await complete(client, url, prompt, 4, rec, t0)
            except (httpx.HTTPError, RuntimeError) as e:
                errors.append(f"quiet {j}: {type(e).__name__}: {e}")
            rec["ttft"] = rec["chunks"][0] - rec["sent"] if rec["chunks"] else None
            quiet.append(rec)
        await asyncio.sleep(0.3)  # the runners' counters settle
        qb = pd_snapshot(url) if args.mode == "pd" else None
    # requests sent and answered in the load window: the transfers the PD counters of that
    # window are about
    window_tokens = [r["prompt_tokens"] for r in streams + longs_out
                     if r.get("sent", -1) >= t_load and r["chunks"] and r["chunks"][0] <= t_end]
    return {"t_base": t_base, "t_load": t_load, "t_last_sent": t_last_sent, "t_end": t_end,
            "idle_after_s": round(idle_after, 1), "idle_left": busy,
            "cpu": {"quiet": cpu_use(cpu["base"], cpu["load"]),
                    "load": cpu_use(cpu["load"], cpu["end"])},
            "streams": streams, "longs": longs_out, "quiet": quiet, "errors": errors,
            "pd": pd_delta(snap0, snap1, window_tokens) if snap0 is not None else None,
            "pd_quiet": pd_delta(qa, qb, [r["prompt_tokens"] for r in quiet if r["chunks"]])
            if qa is not None else None}


def censored_stats(recs: list[dict], t_end: float) -> dict:
    """TTFT p50/p90/max (ms) over all of ``recs``, those without a first token by ``t_end``
    counted at their wait so far: then a lower bound (``*_lower_bound``)."""
    vals = sorted((r["chunks"][0] - r["sent"], False) if r["chunks"] and r["chunks"][0] <= t_end
                  else (t_end - r["sent"], True) for r in recs if "sent" in r)
    out: dict = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("max", 1.0)):
        if not vals:
            out[f"ttft_{name}_ms"], out[f"ttft_{name}_lower_bound"] = None, False
            continue
        i = min(len(vals) - 1, int(q * len(vals)))
        out[f"ttft_{name}_ms"] = 1000 * vals[i][0]
        out[f"ttft_{name}_lower_bound"] = any(c for _, c in vals[:i + 1])
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(mode: str, raw: dict, args) -> dict:
    windows = {"quiet": (raw["t_base"], raw["t_load"]), "load": (raw["t_load"], raw["t_end"])}
    itl: dict[str, list[float]] = {w: [] for w in windows}
    tokens = dict.fromkeys(windows, 0)
    for rec in raw["streams"]:
        c = rec["chunks"]
        for w, (a, b) in windows.items():
            tokens[w] += sum(a <= t < b for t in c)
            itl[w] += [y - x for x, y in zip(c, c[1:]) if a <= y < b]
    out: dict = {"mode": mode}
    for w, (a, b) in windows.items():
        gaps = itl[w]
        out[w] = {"seconds": round(b - a, 2), "gaps": len(gaps),
                  "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
                  "itl_p90_ms": 1000 * pct(gaps, 0.9) if gaps else None,
                  "itl_p99_ms": 1000 * pct(gaps, 0.99) if gaps else None,
                  "itl_max_ms": 1000 * max(gaps) if gaps else None,
                  "decode_tok_s": tokens[w] / (b - a) if b > a else None}
    restarts = [r for r in raw["streams"] if r["round"] > 0 and
                raw["t_load"] <= r.get("sent", -1) < raw["t_end"]]
    restart_ttft = [r["chunks"][0] - r["sent"] for r in restarts if r["chunks"]]
    out["stream_restarts"] = len(restarts)
    out["stream_restarts_started"] = len(restart_ttft)
    out["stream_restart_ttft"] = censored_stats(restarts, raw["t_end"])
    longs = sorted(raw["longs"], key=lambda r: r["index"])
    done = [r for r in longs if r["chunks"] and r["chunks"][0] <= raw["t_end"]]
    out["long"] = {"sent": len(longs), "done": len(done),
                   "failed": sum("error" in r and not r["chunks"] for r in longs),
                   "prompt_tokens_mean": (statistics.mean(r["prompt_tokens"] for r in longs)
                                          if longs else None),
                   "ttft_done_p50_ms": (1000 * statistics.median(r["chunks"][0] - r["sent"]
                                                                 for r in done)
                                        if done else None),
                   **censored_stats(longs, raw["t_end"]),
                   "ttft_per_request_ms": [
                       round(1000 * (r["chunks"][0] - r["sent"])) if r in done else
                       f">{1000 * (raw['t_end'] - r['sent']):.0f}" for r in longs]}
    out["last_sent_to_end_s"] = round(raw["t_end"] - raw["t_last_sent"], 2)
    q = [r for r in raw["quiet"] if r.get("ttft") is not None]
    out["quiet_long"] = {
        "n": len(q), "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in q)
        if q else None,
        "ttft_ms_mean": 1000 * statistics.mean(r["ttft"] for r in q) if q else None,
        "ttft_ms_per_1k": (1000 * sum(r["ttft"] for r in q) /
                           sum(r["prompt_tokens"] for r in q) * 1000) if q else None}
    if raw["pd"] is not None:
        out["pd_load"] = raw["pd"]
        out["pd_quiet"] = raw["pd_quiet"]
    for w in ("quiet", "load"):
        out[w].update(raw["cpu"][w])
    out["idle_after_s"] = raw["idle_after_s"]
    out["errors"] = raw["errors"][:20]
    out["error_count"] = len(raw["errors"])
    return out


def run_mode(mode: str, args, longs: list[str], n_tokens) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"pd-bench-{mode}-"))
    box: list[Server] = []
    ok = False
    busy_before = wait_idle(args.wait_idle)
    try:
        t = time.perf_counter()
        start = start_single if mode == "single" else start_pd
        server = start(args, workdir, box)
        load_s = time.perf_counter() - t
        args.mode = mode
        # a warm-up request (the first one pays one-off costs: graph setup, the model's hash)
        httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "Hello",
                                                         "max_tokens": 2}, timeout=300,
                   trust_env=False).raise_for_status()
        raw = asyncio.run(workload(server.url, server.proc.pid, args, longs, n_tokens))
        if mode == "pd":
            server.pids |= {r["pid"] for r in models_row(server.url)["replicas"] if r["pid"]}
        ok = True
    finally:
        for server in box:
            if not ok:
                print(f"{mode}: failed; logs kept in {workdir}\n{server.log_tail()}",
                      file=sys.stderr)
            server.stop()
        if ok and not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
    out = summarise(mode, raw, args)
    out["load_s"] = round(load_s, 1)
    out["busy_before_cores"] = busy_before
    out["threads"] = (str(args.single_threads) if mode == "single"
                      else f"{args.pd_threads}+{args.pd_threads}")
    return out


# ---- report -----------------------------------------------------------------------------------


def fmt(x, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def ttft(d: dict, name: str, spec: str = ".0f") -> str:
    """A censored TTFT statistic: '>' when it is a lower bound (prompts still waiting)."""
    v = d.get(f"ttft_{name}_ms")
    return "-" if v is None else (">" if d.get(f"ttft_{name}_lower_bound") else "") + \
        format(v, spec)


def report(runs: list[dict], args, long_tokens: list[int]) -> None:
    print(f"{args.streams} decoding streams ({args.stream_tokens} tokens per completion, "
          f"another started when one ends); {len(long_tokens)} long prompts, one every "
          f"{args.interval} s for {args.duration} s, {min(long_tokens)}-{max(long_tokens)} "
          f"tokens (mean {statistics.mean(long_tokens):.0f}; "
          f"{statistics.mean(long_tokens) / args.interval:.0f} prompt tokens/s offered), "
          f"max_tokens 4; max-seqs {args.max_seqs}, chunk-size "
          f"{args.chunk_size or 'default'}, n-batch {args.n_batch or 'default'}")
    print()
    head = (f"{'mode':7} {'threads':>7} {'window':>7} {'secs':>5} {'gaps':>6} {'ITL p50':>8} "
            f"{'p90':>6} {'p99':>6} {'max':>6} {'decode tok/s':>12} {'cores srv/cli/other':>19}")
    print("Decoding streams (ITL in ms, client side; decode tok/s: all streams' tokens over the "
          "window; cores: CPU used on average by the server(s), this client, everything else "
          "on the machine)")
    print(head)
    print("-" * len(head))
    for r in runs:
        for w in ("quiet", "load"):
            s = r[w]
            print(f"{r['mode']:7} {str(r['threads']):>7} {w:>7} {s['seconds']:5.1f} "
                  f"{s['gaps']:6d} {fmt(s['itl_p50_ms'], '8.1f')} {fmt(s['itl_p90_ms'], '6.1f')} "
                  f"{fmt(s['itl_p99_ms'], '6.1f')} {fmt(s['itl_max_ms'], '6.0f')} "
                  f"{fmt(s['decode_tok_s'], '12.1f')} "
                  f"{s.get('server_cores', 0):>9.2f}/{s.get('client_cores', 0):.2f}/"
                  f"{s.get('other_cores', 0):.2f}")
    print()
    head = (f"{'mode':7} {'sent':>4} {'done':>4} {'fail':>4} {'TTFT p50':>9} {'p90':>8} "
            f"{'max':>8} {'p50 done':>8} {'quiet TTFT':>10} {'per 1k tok':>10}")
    print("Long prompts (TTFT in ms, client side, over all sent: '>' a lower bound, prompts still "
          "waiting when the load window ended counted at their wait so far; done: first token "
          "within the window; quiet: alone on an idle server)")
    print(head)
    print("-" * len(head))
    for r in runs:
        lo, q = r["long"], r["quiet_long"]
        print(f"{r['mode']:7} {lo['sent']:4d} {lo['done']:4d} {lo['failed']:4d} "
              f"{ttft(lo, 'p50'):>9} {ttft(lo, 'p90'):>8} {ttft(lo, 'max'):>8} "
              f"{fmt(lo['ttft_done_p50_ms'], '8.0f')} "
              f"{fmt(q['ttft_ms_mean'], '10.0f')} {fmt(q['ttft_ms_per_1k'], '10.0f')}")
    for r in runs:
        rs = r["stream_restart_ttft"]
        print(f"  {r['mode']}: load window {r['load']['seconds']} s, ending "
              f"{r['last_sent_to_end_s']} s after the last long prompt was sent; TTFT per long "
              f"prompt, in order sent (ms): {r['long']['ttft_per_request_ms']}")
        print(f"    stream completions started during the load window "
              f"{r['stream_restarts']} (first token by its end: "
              f"{r['stream_restarts_started']}), their TTFT p50 {ttft(rs, 'p50')} ms, max "
              f"{ttft(rs, 'max')} ms")
        print(f"    ready in {r['load_s']} s; machine busy before "
              f"{fmt(r['busy_before_cores'], '.2f')} cores; runners idle {r['idle_after_s']} s "
              f"after the run; client errors {r['error_count']}")
        for e in r["errors"][:5]:
            print(f"    {e}")
    for r in runs:
        if "pd_load" not in r:
            continue
        print()
        print("PD KV transfer, per 1,000 prompt tokens (runner metrics: export on the prefill "
              "runner, import on the decode runner; gw prefill: the gateway's prefill_seconds, "
              "sending to the prefill runner -> holding the KV, prefill included)")
        head = (f"{'':6} {'requests':>8} {'transfers':>9} {'exp/imp':>7} {'tokens':>7} "
                f"{'export ms':>9} {'import ms':>9} {'gw prefill ms':>13} {'bytes/token':>11} "
                f"{'fallbacks':>9} {'imp fail':>8}")
        print(head)
        print("-" * len(head))
        for label, d in (("load", r["pd_load"]), ("quiet", r.get("pd_quiet"))):
            if not d:
                continue
            print(f"{label:6} {d['requests']:8d} {d['transfers']:9d} "
                  f"{d['exports']:>3d}/{d['imports']:<3d} {d['prompt_tokens']:7d} "
                  f"{fmt(d['export_ms_per_1k'], '9.1f')} {fmt(d['import_ms_per_1k'], '9.1f')} "
                  f"{fmt(d['gateway_prefill_ms_per_1k'], '13.0f')} "
                  f"{fmt(d['bytes_per_token'], '11.0f')} {d['fallbacks']:9d} "
                  f"{d['import_failures']:8d}")
        if r["pd_load"]["fallback_reasons"]:
            print(f"  fallbacks by reason: {r['pd_load']['fallback_reasons']}")
    by = {r["mode"]: r for r in runs}
    if "single" in by and "pd" in by:
        s, p = by["single"], by["pd"]
        print()
        for key, label in (("itl_p50_ms", "ITL p50"), ("itl_p99_ms", "ITL p99"),
                           ("decode_tok_s", "decode tok/s")):
            if s["load"][key] and p["load"][key]:
                print(f"under load, {label}: single {s['load'][key]:.1f}, pd "
                      f"{p['load'][key]:.1f} (pd/single {p['load'][key] / s['load'][key]:.2f})")
        if s["long"]["ttft_p50_ms"] and p["long"]["ttft_p50_ms"]:
            print(f"long-prompt TTFT p50: single {ttft(s['long'], 'p50')} ms, pd "
                  f"{ttft(p['long'], 'p50')} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the demo model); a base "
                    "model is fine (/v1/completions)")
    ap.add_argument("--modes", default="single,pd", help="comma-separated: single, pd")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=300,
                    help="max_tokens of each stream completion (restarted when done)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between long prompts")
    ap.add_argument("--duration", type=float, default=20.0,
                    help="seconds during which long prompts are sent")
    ap.add_argument("--min-tokens", type=int, default=1000, help="long prompt size, smallest")
    ap.add_argument("--max-tokens", type=int, default=2000, help="long prompt size, largest")
    ap.add_argument("--baseline", type=float, default=5.0,
                    help="quiet seconds (streams only) before the long prompts")
    ap.add_argument("--drain", type=float, default=120.0, help="after the last long prompt is "
                    "sent, seconds to wait for the first tokens of those still waiting")
    ap.add_argument("--idle-timeout", type=float, default=300.0, help="after the run, seconds "
                    "to wait for the runners to finish what they still hold")
    ap.add_argument("--quiet", type=int, default=3,
                    help="long prompts sent alone after the run (idle TTFT, transfer cost)")
    ap.add_argument("--single-threads", type=int, default=2)
    ap.add_argument("--pd-threads", type=int, default=1, help="per runner")
    ap.add_argument("--max-seqs", type=int, default=12, help="per runner")
    ap.add_argument("--chunk-size", type=int, default=0, help="0: serve's default")
    ap.add_argument("--n-batch", type=int, default=0,
                    help="token budget of one engine step (0: serve's default)")
    ap.add_argument("--wait-idle", type=float, default=300.0,
                    help="before each mode, wait at most this long for the machine's CPUs to "
                    "be (nearly) idle: other work on the same cores skews everything (0: don't)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-timeout", type=float, default=300.0)
    ap.add_argument("--keep-logs", action="store_true", help="keep each run's temp dir")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"single", "pd"}:
        ap.error("--modes: single and/or pd")
    if not 0 < args.min_tokens <= args.max_tokens:
        ap.error("--min-tokens must be in 1..--max-tokens")
    args.model = resolve_model(args.model)
    # SIGTERM ends the benchmark like Ctrl-C: through the finally blocks that stop servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    n_tokens = tokenizer(args.model)
    rng = random.Random(args.seed)
    count = max(1, int(args.duration / args.interval + 1e-9))
    longs = [long_prompt(str(i), args.seed * 7919 + i,
                         rng.randint(args.min_tokens, args.max_tokens), n_tokens)
             for i in range(count)]
    long_tokens = [n_tokens(p) for p in longs]
    runs = []
    for mode in modes:
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        runs.append(run_mode(mode, args, longs, n_tokens))
    report(runs, args, long_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "mode")},
            "long_prompt_tokens": long_tokens, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
