"""``justllm quantize``: re-quantize a GGUF with llama.cpp's own quantizer."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from justllm.cli.background import run_interruptible
from justllm.cli.completion import one_of, quant_types
from justllm.cli.errors import cli_errors

if TYPE_CHECKING:
    from justllm.models.quantize import QuantType
    from justllm.models.registry import Rewritten


def quantize(
    context: typer.Context,
    model: Annotated[Optional[str], typer.Argument(help="The model: a path, a name from 'justllm models', or a Hugging Face REPO[:FILE].", show_default=False)] = None,
    type_name: Annotated[Optional[str], typer.Argument(metavar="TYPE", autocompletion=one_of(quant_types), help="llama.cpp's type name, e.g. Q4_K_M, Q8_0, IQ4_XS, F16 (--list shows them all).", show_default=False)] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Where to write it (default: <stem>-<type>.gguf in the models directory, registered as a model); a directory (an existing one, or one ending in '/', made if need be) gets <stem>-<type>.gguf inside.")] = None,
    allow_requantize: Annotated[bool, typer.Option("--allow-requantize", help="Quantize a model that is quantized already (it loses more quality than quantizing its F16/BF16 original).")] = False,
    imatrix: Annotated[Optional[str], typer.Option("--imatrix", help="Importance matrix from llama.cpp's llama-imatrix (GGUF or .dat): better low-bit quality; IQ1/IQ2 types need one.")] = None,
    threads: Annotated[int, typer.Option("--threads", "-t", help="CPU threads (0: all cores).")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output file.")] = False,
    list_types: Annotated[bool, typer.Option("--list", help="List the quantization types with llama.cpp's descriptions, then exit.")] = False,
) -> None:
    """Quantize MODEL to TYPE through llama.cpp (llama_model_quantize).

    The output goes to the models directory and shows in 'justllm models' with its type, unless
    --output says where. A failed or interrupted run leaves no partial file."""
    with cli_errors():
        if list_types:
            if model or type_name:  # (they were ignored: the list came, nothing quantized)
                raise ValueError("--list lists the types and quantizes nothing: give it "
                                 "without MODEL and TYPE")
            return _print_types()
        if not model or not type_name:
            raise ValueError("give MODEL and TYPE, e.g. justllm quantize gemma-3-270m Q8_0 "
                             "(justllm quantize --list shows the types)")
        from justllm.cli.plugins import plugins_of
        from justllm.models.quantize import prepare, quant_type

        qtype = quant_type(type_name)
        warn_if_trained_for(qtype)
        plugins = plugins_of(context)
        src = Path(plugins.resolve_model(model))
        dst, make_dir = _output_path(output, _named(src, plugins.served_name(model)), qtype)
        job = prepare(src, qtype, dst, force=force, allow_requantize=allow_requantize,
                      imatrix=imatrix, threads=threads, make_dir=make_dir)
        t0 = time.monotonic()
        _run_with_progress(job)
        console = Console(highlight=False, emoji=False)
        from justllm.cli.models import _size

        console.print(f"wrote {dst} ({qtype.name}, {_size(dst.stat().st_size)}; "
                      f"{src.name} was {_size(src.stat().st_size)}) in "
                      f"{time.monotonic() - t0:.1f} s", markup=False, soft_wrap=True)
        _register(console, dst, src, registered=not output)


def warn_if_trained_for(qtype: QuantType) -> None:
    """Q1_0, Q2_0, TQ1_0 and TQ2_0 are for models trained in them: llama.cpp quantizes any
    model to them saying nothing, and the answers are gibberish."""
    if qtype.trained_for:
        Console(stderr=True, highlight=False, emoji=False).print(
            f"[yellow]warning:[/yellow] {qtype.name} is for models trained with "
            f"{qtype.trained_for} weights; any other model quantized to it answers "
            "gibberish (Q2_K or IQ2_XXS with --imatrix are the small types for others)",
            soft_wrap=True)


def _named(src: Path, served: str | None) -> Path:
    """``src`` as the default output's name reads it: under the name a plugin's source serves
    it as (``ollama:llama3.2`` -> ``llama3.2``, as the registry names a file), not its file's
    (an Ollama blob's ``sha256-<hex>``)."""
    from justllm.models.refs import name_for_file

    return src.with_name(f"{name_for_file(served)}.gguf") if served and served.strip() else src


def _output_path(output: str | None, src: Path, qtype: QuantType) -> tuple[Path, bool]:
    """Where the output goes, and whether its directory is still to be made: the models
    directory by default; ``-o DIR/`` (trailing slash) or an existing ``-o DIR`` means the
    default file name in that directory, not a file called DIR."""
    from justllm.models.quantize import check_output_option, default_output
    from justllm.models.store import models_dir

    check_output_option(output)
    if not output:
        models_dir().mkdir(parents=True, exist_ok=True)
        return default_output(src, qtype, models_dir()), False
    path = Path(output).expanduser()
    if path.is_dir() or output.endswith(("/", os.sep)):
        return default_output(src, qtype, path), not path.is_dir()
    return path, False


def _register(console: Console, dst: Path, src: Path, *, registered: bool) -> None:
    """Bring the registry in line with the disk: a registered file that was overwritten
    (--force) has its old version dropped and its tags moved to the new one; the default
    output is then tagged ``<stem>-<type>:latest``, saying when that tag moved from another
    version."""
    from justllm.models.manifest import Source
    from justllm.models.refs import name_for_file
    from justllm.models.registry import Registry

    registry = Registry()
    source = Source("quantized", file=str(src.resolve()),
                    revision=f"sha256:{registry.digests.digest(src)}")
    rewritten = registry.rewritten(dst, source)
    say_replaced(console, rewritten)
    if not registered:
        return
    m = rewritten.manifest if rewritten is not None else registry.register(dst, source)
    key, _, before = registry.tag(m.digest, name_for_file(dst.stem))
    moved_from = f"; moved from sha256:{before.short}, which is kept" if before else ""
    console.print(f"registered as {key} (justllm run {key.removesuffix(':latest')}){moved_from}",
                  markup=False, soft_wrap=True)


def say_replaced(console: Console, rewritten: Rewritten | None) -> None:
    """What ``Registry.rewritten`` did to a registered file overwritten with ``--force``."""
    if rewritten is None or not rewritten.dropped:
        return
    old = ", ".join(f"sha256:{m.short}" for m in rewritten.dropped)
    verb = "points" if len(rewritten.moved) == 1 else "point"
    moved = (f"; {', '.join(rewritten.moved)} now {verb} to sha256:"
             f"{rewritten.manifest.short}" if rewritten.moved else "")
    console.print(f"replaced {old} (its file was overwritten){moved}", markup=False,
                  soft_wrap=True)


def _print_types() -> None:
    from rich.table import Table

    from justllm.models.quantize import QUANT_TYPES

    table = Table("TYPE", "DESCRIPTION (llama.cpp's)", "NOTE", box=None, pad_edge=False)
    for t in QUANT_TYPES:
        note = ("needs --imatrix" if t.needs_imatrix
                else f"only for {t.trained_for} models" if t.trained_for else "")
        table.add_row(t.name, t.description, note)
    Console(highlight=False, emoji=False).print(table)


def _run_with_progress(job) -> None:
    """``job.run()`` on a worker thread with a progress bar fed by llama.cpp's per-tensor log.
    The main thread stays free for Ctrl-C: then the partial file is removed and the process
    ends at once (the quantizer, in C, cannot be stopped, and it must not be left running
    while the interpreter shuts down)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(SpinnerColumn(), TextColumn(f"quantizing to {job.qtype.name}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("[dim]{task.fields[tensor]}"), transient=True,
                  console=Console(stderr=True, emoji=False)) as progress:
        task = progress.add_task("quantize", total=None, tensor="")

        def on_tensor(i: int, n: int, name: str) -> None:
            progress.update(task, completed=i - 1, total=n, tensor=name)

        run_interruptible(lambda: job.run(on_tensor), job.abandon, progress, "justllm-quantize")
