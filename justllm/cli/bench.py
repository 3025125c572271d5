"""``justllm bench``: the serving benchmark (the fields of ``vllm bench serve``)."""

from __future__ import annotations

import json
import math
import signal
from functools import partial
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from justllm.cli.completion import one_of
from justllm.cli.errors import cli_errors
from justllm.cli.options import typed

WORKLOADS = ("random", "shared-prefix", "sharegpt")
MIN_REQUEST_RATE = 0.001  # requests per second (one every 1,000 s, on average)


def bench(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(help="A model for bench to serve itself (path or name; default: the demo model) when no --url is given.", show_default=False)] = None,
    url: Annotated[Optional[str], typer.Option("--url", help="An OpenAI-compatible server to measure (e.g. http://127.0.0.1:8080).")] = None,
    vs: Annotated[Optional[str], typer.Option("--vs", help="A second endpoint: same workload, side by side with ratios.")] = None,
    workload: Annotated[str, typer.Option("--workload", autocompletion=one_of(lambda: WORKLOADS), help=" | ".join(WORKLOADS))] = "random",
    dataset: Annotated[Optional[Path], typer.Option("--dataset", help="ShareGPT-style JSON file (sets --workload sharegpt).")] = None,
    num_requests: Annotated[int, typer.Option("--num-requests", "-n", help="Requests to send.")] = 32,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="Most requests in flight.")] = 8,
    request_rate: Annotated[Optional[float], typer.Option("--request-rate", help="Poisson arrivals per second, at least 0.001 (default: all at once, bounded by --concurrency).")] = None,
    input_len: Annotated[int, typer.Option("--input-len", help="Words per random prompt / question (a word is about a token; a prompt holds at most 1048576).")] = 64,
    prefix_len: Annotated[int, typer.Option("--prefix-len", help="Words in the shared prefix (shared-prefix workload; with --input-len at most 1048576).")] = 1000,
    output_len: Annotated[Optional[int], typer.Option("--output-len", help="Tokens to generate per request (default 128; sharegpt: the recorded reply's length in words).", show_default=False)] = None,
    served_model: Annotated[Optional[str], typer.Option("--model-name", help="The model id to send (default: none; the server's own).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="JUSTLLM_API_KEY", help="Bearer key for the endpoint(s).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed for prompts and arrivals.")] = 0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the results as JSON to this file.")] = None,
    max_seqs: Annotated[Optional[int], typer.Option("--max-seqs", help="--max-seqs of the server bench starts itself (default 8; not with --url).", show_default=False)] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature of every request (0: greedy).")] = 0.0,
    top_p: Annotated[Optional[float], typer.Option("--top-p", help="top_p of every request (default: not sent).", show_default=False)] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="top_k of every request (default: not sent; llama-server then applies its own 40).", show_default=False)] = None,
    min_p: Annotated[Optional[float], typer.Option("--min-p", help="min_p of every request (default: not sent; llama-server then applies its own 0.05).", show_default=False)] = None,
) -> None:
    """Benchmark serving: request/token throughput, TTFT, TPOT, ITL and end-to-end latency
    (mean, median, p90, p99), errors, prefix-cache hit ratio and speculation acceptance."""
    with cli_errors():
        import asyncio

        from rich.progress import Progress

        from justllm.bench import workloads as w
        from justllm.bench.report import summarize, table
        from justllm.bench.runner import run_workload, sampling_fields
        from justllm.chat.backends import check_url, remote_base

        if output_len is None and dataset is None and workload != "sharegpt":
            output_len = 128
        if (num_requests < 1 or concurrency < 1 or (output_len is not None and output_len < 1)
                or input_len < 1):
            raise ValueError("--num-requests, --concurrency, --output-len and --input-len must be >= 1")
        if prefix_len < 0:
            raise ValueError("--prefix-len must be >= 0")
        if num_requests > w.MAX_REQUESTS:  # (each is a task, all made before the run)
            raise ValueError(f"--num-requests must be at most {w.MAX_REQUESTS}")
        for flag, words in (("--input-len", input_len), ("--prefix-len", prefix_len)):
            if words > w.MAX_PROMPT_WORDS:
                raise ValueError(f"{flag} must be at most {w.MAX_PROMPT_WORDS} words (about a "
                                 f"token each: more than any model's context), got {words}")
        if max_seqs is not None and max_seqs < 1:
            raise ValueError("--max-seqs must be >= 1")
        for flag, address in (("--url", url), ("--vs", vs)):
            if address is not None:  # before the run: it printed a table of dashes first
                check_url(address, flag)
        if json_out is not None:  # found out before the run, not after it
            if json_out.is_dir():
                raise ValueError(f"--json: {json_out} is a directory; give a file path")
            if not json_out.parent.is_dir():
                raise ValueError(f"--json: the directory {json_out.parent} does not exist")
            from justllm.models.quantize import check_writable  # (numpy: not at every start)

            try:
                check_writable(json_out.parent)
            except ValueError as e:
                raise ValueError(f"--json: {e}") from None
        # (nan ran; 1e-320 drew an infinite wait after the first request)
        if request_rate is not None and not MIN_REQUEST_RATE <= request_rate < math.inf:
            raise ValueError(f"--request-rate must be a finite number of requests per second, "
                             f"at least {MIN_REQUEST_RATE:g}")
        if url is not None and model is not None:
            raise ValueError("MODEL is for the server bench starts itself; --url measures the "
                             "model that server serves")
        if url is not None and max_seqs is not None:
            raise ValueError("--max-seqs is for the server bench starts itself; --url measures "
                             "a server as it was started")
        sampling = sampling_fields(temperature, top_p, top_k, min_p)
        if dataset is not None:
            if typed(ctx, "workload") and workload != "sharegpt":
                raise ValueError(f"--dataset is the sharegpt workload's prompts: not with "
                                 f"--workload {workload}")
            workload = "sharegpt"
        if typed(ctx, "prefix_len") and workload != "shared-prefix":
            raise ValueError("--prefix-len is the shared-prefix workload's (--workload "
                             "shared-prefix)")
        if typed(ctx, "input_len") and workload == "sharegpt":
            raise ValueError("--input-len is for the random and shared-prefix workloads: "
                             "sharegpt's prompts are the dataset's")
        per_prompt = input_len + (prefix_len if workload == "shared-prefix" else 0)
        if per_prompt > w.MAX_PROMPT_WORDS:
            raise ValueError(f"--prefix-len + --input-len must be at most {w.MAX_PROMPT_WORDS} "
                             f"words (about a token each: more than any model's context), got "
                             f"{per_prompt}")
        if workload in ("random", "shared-prefix") and num_requests * per_prompt > w.MAX_TOTAL_WORDS:
            raise ValueError(f"--num-requests {num_requests} prompts of {per_prompt} words are "
                             f"{num_requests * per_prompt} words, more than the "
                             f"{w.MAX_TOTAL_WORDS} bench builds in memory before a run: send "
                             "fewer requests or shorter prompts")
        if workload == "random":
            requests = w.random_prompts(num_requests, input_len, output_len or 128, seed)
        elif workload == "shared-prefix":
            requests = w.shared_prefix_prompts(num_requests, prefix_len, input_len, output_len or 128,
                                               seed)
        elif workload == "sharegpt":
            if dataset is None:
                raise ValueError("--workload sharegpt needs --dataset FILE")
            requests = w.sharegpt_prompts(dataset, num_requests, output_len, seed)
        else:
            raise ValueError(f"unknown workload '{workload}' ({', '.join(WORKLOADS)})")

        console = Console(stderr=True, emoji=False)
        server = None
        summaries = []
        # SIGTERM or SIGHUP: exit through the finally below, which stops bench's own server
        # (their default ended bench at once and left it running)
        previous = {sig: signal.signal(sig, _exit_on) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            if url is None:
                from justllm.bench.local_server import LocalServer

                console.print("starting a local justllm server for the benchmark…")
                server = LocalServer.start(model, max_seqs=8 if max_seqs is None else max_seqs)
                url = server.url
            for target in [url] + ([vs] if vs else []):
                target = remote_base(target)  # a server's root or its OpenAI base URL
                with Progress(console=console, transient=True) as progress:
                    task = progress.add_task(f"{target}", total=len(requests))
                    run = asyncio.run(run_workload(
                        target, requests, concurrency=concurrency, request_rate=request_rate,
                        model=served_model, api_key=api_key, seed=seed, sampling=sampling,
                        on_done=partial(progress.advance, task)))
                summaries.append({**summarize(run), "sampling": sampling})
        finally:
            if server is not None:
                server.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        Console(emoji=False).print(table(summaries))
        for s in summaries:
            if s["first_error"]:
                console.print(f"[yellow]{s['url']}: {s['failed']} failed; first error: "
                              f"{s['first_error']}[/yellow]", highlight=False, soft_wrap=True)
        if json_out is not None:
            try:
                json_out.write_text(json.dumps(summaries if vs else summaries[0], indent=2))
            except OSError as e:
                raise ValueError(f"--json: cannot write {json_out}: {e.strerror}") from None
        dead = [str(s["url"]) for s in summaries if s["completed"] == 0]
        if dead:  # nothing measured: a benchmark that failed, whatever the table shows
            raise ValueError(f"every request failed at {', '.join(dead)}")


def _exit_on(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
