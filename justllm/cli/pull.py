"""``justllm pull``: download a GGUF from a Hugging Face repo into the model registry."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console

from justllm.cli.completion import one_of, outtypes, quant_types
from justllm.cli.convert import OUTTYPE_HELP, QUANTIZE_HELP, run_conversion
from justllm.cli.errors import cli_errors
from justllm.models.hub import pick_gguf, split_ref  # noqa: F401  (re-exported for callers and tests)


def _with_convert(help_text: str) -> str:
    """``convert``'s help for an option ``pull`` takes only with --convert."""
    return f"With --convert: {help_text[0].lower()}{help_text[1:]}"


def pull(
    context: typer.Context,
    model: Annotated[str, typer.Argument(
        help="REPO or REPO:FILE on the Hugging Face Hub, e.g. "
             "bartowski/Qwen2.5-0.5B-Instruct-GGUF:Qwen2.5-0.5B-Instruct-Q4_K_M.gguf.")],
    tag: Annotated[Optional[str], typer.Option("--tag", "-t", help="NAME[:TAG] to give it (default: the file name without .gguf, lowercased, :latest).")] = None,
    revision: Annotated[str, typer.Option("--revision", help="Branch, tag or commit.")] = "main",
    force: Annotated[bool, typer.Option("--force", help="Download again even if the local copy is up to date (with --convert: overwrite the converted file).")] = False,
    convert: Annotated[bool, typer.Option("--convert", help="The repo is a safetensors model: download it and convert it to GGUF with llama.cpp's converter (needs justllm\\[convert]; see 'justllm convert').")] = False,
    outtype: Annotated[str, typer.Option("--outtype", autocompletion=one_of(outtypes), help=_with_convert(OUTTYPE_HELP))] = "auto",
    quantize: Annotated[Optional[str], typer.Option("--quantize", "-q", metavar="TYPE", autocompletion=one_of(quant_types), help=_with_convert(QUANTIZE_HELP))] = None,
) -> None:
    """Download a GGUF model from Hugging Face into the models directory and record it with the
    commit it resolved to and its sha256 (REPO alone picks its only .gguf file, or its Q4_K_M
    one; HF_ENDPOINT and HF_TOKEN are honoured). Pulling a newer revision moves the tag and
    keeps the older version until 'justllm rm'. A repo with safetensors and no GGUF:
    --convert converts it (as 'justllm convert REPO' does)."""
    with cli_errors():
        from justllm.cli.plugins import check_new_name, plugins_of

        check_new_name(plugins_of(context), tag)
        if convert:
            if ":" in model:
                raise ValueError("--convert takes REPO (a safetensors model), not REPO:FILE")
            from justllm.models.convert_lora import is_adapter

            if is_adapter(model, revision):
                raise ValueError(f"{model} is a PEFT LoRA adapter: 'justllm convert {model}' "
                                 "turns it into an adapter GGUF for --lora")
            return run_conversion(model, outtype=outtype, quantize=quantize, output=None,
                                  name=tag, revision=revision, force=force)
        given = [n for n, v in (("--outtype", outtype != "auto"), ("--quantize", quantize))
                 if v]
        if given:
            raise ValueError(f"{' and '.join(given)} {'go' if len(given) > 1 else 'goes'} with "
                             "--convert" + (" (to quantize a GGUF: justllm quantize)"
                                            if quantize else ""))
        from justllm.cli.background import terminable
        from justllm.models.registry import Registry

        console = Console(highlight=False, emoji=False)
        # SIGTERM and SIGHUP (a closed terminal) end the download as Ctrl-C does, so the hub
        # library deletes its partial file (their default ended the process and left it).
        with terminable():
            p = Registry().pull(model, tag=tag, revision=revision, force=force,
                                console=console)
        m, d = p.manifest, p.download
        console.print(f"pulled {d.repo}:{d.file} @ {d.revision[:12]} -> {p.label} "
                      f"(sha256:{m.short}, {m.path})", markup=False, soft_wrap=True)
        if p.previous is not None:
            console.print(f"{p.label} was sha256:{p.previous.short}: that version is kept "
                          f"('justllm rm sha256:{p.previous.short}' removes it)", markup=False,
                          soft_wrap=True)
