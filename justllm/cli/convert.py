"""``justllm convert``: a Hugging Face safetensors model to GGUF with llama.cpp's own converter
(also what ``justllm pull REPO --convert`` runs)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from justllm.cli.background import run_interruptible, terminable
from justllm.cli.completion import one_of, outtypes, quant_types
from justllm.cli.errors import cli_errors

if TYPE_CHECKING:
    from justllm.models.convert import AlreadyConverted
    from justllm.models.manifest import Manifest

OUTTYPE_HELP = ("What the converter writes: f16, bf16, q8_0, f32, or auto (bf16 for a model "
                "stored in bfloat16, else f16).")
QUANTIZE_HELP = ("Then quantize to this llama.cpp type (Q4_K_M, Q8_0, ...; 'justllm quantize "
                 "--list' shows them).")


def convert(
    context: typer.Context,
    source: Annotated[str, typer.Argument(help="A local Hugging Face model directory (config.json, tokenizer, *.safetensors) or a hub repo id OWNER/NAME; or a PEFT LoRA adapter's (adapter_config.json, adapter_model.safetensors).", show_default=False)],
    outtype: Annotated[str, typer.Option("--outtype", autocompletion=one_of(outtypes), help=OUTTYPE_HELP)] = "auto",
    quantize: Annotated[Optional[str], typer.Option("--quantize", "-q", metavar="TYPE", autocompletion=one_of(quant_types), help=QUANTIZE_HELP)] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Where to write the GGUF (default: NAME-TYPE.gguf in the models directory). It is registered either way.")] = None,
    name: Annotated[Optional[str], typer.Option("--name", "-n", metavar="NAME[:TAG]", help="What to register it as (default: the file name without .gguf, :latest).")] = None,
    revision: Annotated[str, typer.Option("--revision", help="Branch, tag or commit (a hub repo).")] = "main",
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output file.")] = False,
    base: Annotated[Optional[str], typer.Option("--base", metavar="MODEL", help="A LoRA adapter's base model: a local model folder or a hub repo (only its config and tokenizer are read). Default: the adapter's base_model_name_or_path.")] = None,
) -> None:
    """Convert a Hugging Face safetensors model to GGUF with llama.cpp's own converter, then
    optionally quantize it, and add it to the models directory. A PEFT LoRA adapter becomes
    llama.cpp's adapter GGUF (NAME-lora-TYPE.gguf here, for --lora NAME=FILE; not registered).

    Needs the converter's dependencies: pip install 'justllm\\[convert]'. The converter
    itself (matching the installed llama.cpp) is fetched from PyPI on first use. A hub repo's
    files go to the Hugging Face cache; the revision is recorded. A failed or interrupted
    conversion leaves no partial file."""
    with cli_errors():
        from justllm.cli.plugins import check_new_name, plugins_of
        from justllm.models.convert_lora import is_adapter

        if not source.strip():  # (it read the current folder)
            raise ValueError("the model to convert is empty: pass a Hugging Face model's "
                             "folder or a repo id OWNER/NAME")

        check_new_name(plugins_of(context), name)

        if is_adapter(source, revision):
            if quantize or name:
                raise ValueError(f"{'--quantize' if quantize else '--name'} is for models: "
                                 f"{source} is a LoRA adapter (its --outtype may be q8_0; it "
                                 "is not registered)")
            return run_lora_conversion(source, base=base, outtype=outtype, output=output,
                                       revision=revision, force=force)
        if base is not None:
            raise ValueError(f"--base is for a LoRA adapter: {source} is not one (no "
                             "adapter_config.json)")
        run_conversion(source, outtype=outtype, quantize=quantize, output=output, name=name,
                       revision=revision, force=force)


def run_lora_conversion(source: str, *, base: str | None, outtype: str, output: str | None,
                        revision: str, force: bool) -> None:
    from justllm.cli.models import _size
    from justllm.models.convert_lora import prepare_lora

    err = Console(stderr=True, highlight=False, emoji=False)
    with terminable():  # (the converter's fetch, a hub download: see run_conversion)
        job = prepare_lora(source, base=base, outtype=outtype, output=output,
                           revision=revision, force=force, console=err)
    err.print(f"converting the LoRA adapter {job.source_dir} (rank {job.rank}, alpha "
              f"{job.alpha:g}) for {job.model.where} "
              f"({job.model.candidate_architectures()[0]}) to {job.output_type} with "
              f"llama.cpp's convert_lora_to_gguf.py (llama-cpp-python {job.converter.version})",
              markup=False, soft_wrap=True)
    t0 = time.monotonic()
    _run_with_progress(job)
    Console(highlight=False, emoji=False).print(
        f"wrote {job.dst} ({job.output_type}, {_size(job.dst.stat().st_size)}) in "
        f"{time.monotonic() - t0:.1f} s; load it with --lora NAME={job.dst}", markup=False,
        soft_wrap=True)


def run_conversion(source: str, *, outtype: str, quantize: str | None, output: str | None,
                   name: str | None, revision: str, force: bool) -> None:
    """Prepare (checks, downloads), convert with progress, register, and say what happened."""
    from justllm.cli.models import _size
    from justllm.models.convert import AlreadyConverted, prepare, register

    err = Console(stderr=True, highlight=False, emoji=False)
    if quantize:  # (an unknown type is refused by prepare, in words)
        from justllm.cli.quantize import warn_if_trained_for
        from justllm.models.quantize import QUANT_TYPES

        for qtype in QUANT_TYPES:
            if qtype.name == quantize.strip().upper():
                warn_if_trained_for(qtype)
    try:
        # SIGTERM and SIGHUP end the converter's first fetch and a hub download as Ctrl-C
        # does: their default ended justllm alone, and `pip download` went on writing some
        # 80 MB into a temporary folder of the converter cache that nothing removed.
        with terminable():
            job = prepare(source, outtype=outtype, quantize=quantize, output=output,
                          name=name, revision=revision, force=force, console=err)
    except AlreadyConverted as done:
        return _already_converted(done)
    origin = f"{job.repo} @ {job.commit[:12]}" if job.repo and job.commit else str(job.source_dir)
    err.print(f"converting {origin} ({job.model.candidate_architectures()[0]}, about "
              f"{_count(job.model.parameters)} parameters) to {job.output_type} with "
              f"llama.cpp's converter (llama-cpp-python {job.converter.version})",
              markup=False, soft_wrap=True)
    t0 = time.monotonic()
    _run_with_progress(job)
    console = Console(highlight=False, emoji=False)
    console.print(f"wrote {job.dst} ({job.output_type}, {_size(job.dst.stat().st_size)}) in "
                  f"{time.monotonic() - t0:.1f} s", markup=False, soft_wrap=True)
    _say_registered(console, *register(job))


def _run_with_progress(job) -> None:
    """``job.run()`` on a worker thread with a progress bar fed by the converter's output and
    then the quantizer's. The main thread stays free for Ctrl-C: then the converter is stopped,
    the temporary files removed, and the process ends at once (a quantization, in C, cannot be
    stopped)."""
    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    labels = {"tensors": "converting: reading tensors", "writing": "converting: writing GGUF",
              "quantizing": f"quantizing to {job.output_type}"}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TaskProgressColumn(), TextColumn("[dim]{task.fields[detail]}"),
                  TimeElapsedColumn(), transient=True,
                  console=Console(stderr=True, emoji=False)) as progress:
        task = progress.add_task("converting: starting llama.cpp's converter", total=None,
                                 detail="")

        def on_progress(stage: str, done: int, total: int | None) -> None:
            detail = f"{done} tensors" if stage == "tensors" else (
                f"tensor {done + 1}/{total}" if stage == "quantizing" else "")
            progress.update(task, description=labels.get(stage, stage), completed=done,
                            total=total, detail=detail)

        run_interruptible(lambda: job.run(on_progress), job.abandon, progress, "justllm-convert")


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _already_converted(done: AlreadyConverted) -> None:
    """A repeated conversion (``convert`` or ``pull --convert``): the output is this very
    conversion, registered, so it is only (re)tagged, as a repeated plain pull only records
    the tag."""
    from justllm.models.registry import Registry

    key, m, before = Registry().tag(done.manifest.digest, done.label)
    console = Console(highlight=False, emoji=False)
    console.print(f"{m.source} ({m.quantization}) is already here: {done.dst}", markup=False,
                  soft_wrap=True)
    _say_registered(console, key, m, before)


def _say_registered(console: Console, key: str, m: Manifest, before: Manifest | None) -> None:
    """The tag a conversion is known by now (and the version it moved from, kept)."""
    moved = f"; it was sha256:{before.short}, which is kept" if before else ""
    console.print(f"registered as {key} (sha256:{m.short}; justllm run "
                  f"{key.removesuffix(':latest')}){moved}", markup=False, soft_wrap=True)
