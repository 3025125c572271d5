"""``justllm draft make``: a layer-truncated copy of a model, to use as its speculative draft."""

from __future__ import annotations

import contextlib
import os
from typing import Annotated, Optional

import typer
from rich.console import Console

from justllm.cli.errors import cli_errors
from justllm.cli.group import OneLineSummaries

app = typer.Typer(help="Build draft models for speculative decoding.", no_args_is_help=True,
                  cls=OneLineSummaries, context_settings={"help_option_names": ["-h", "--help"]})


@app.command("make")
def make(
    context: typer.Context,
    model: Annotated[str, typer.Argument(help="The target model: a path, a name from 'justllm models', or a Hugging Face REPO[:FILE].")],
    layers: Annotated[int, typer.Option("--layers", "-l", help="Transformer blocks to keep (1 to the model's count minus one).")],
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Where to write it (default: <stem>-draft-L<N>.gguf next to the model, or in the models directory; -o DIR/ or an existing DIR: that name in DIR).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output file.")] = False,
) -> None:
    """Write the model's first N layers as a draft GGUF with the same vocabulary.

    Not retrained: it agrees with the target less often than a real small sibling would."""
    with cli_errors():
        from pathlib import Path

        from justllm.cli.background import terminable
        from justllm.cli.models import _size
        from justllm.cli.plugins import plugins_of
        from justllm.cli.quantize import say_replaced
        from justllm.models.draft import default_draft_path, make_draft
        from justllm.models.manifest import Source
        from justllm.models.quantize import check_output_option, made_folder
        from justllm.models.registry import Registry

        check_output_option(output)
        src = Path(plugins_of(context).resolve_model(model))
        dst = Path(output).expanduser() if output else default_draft_path(src, layers)
        folder: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if output and (dst.is_dir() or output.endswith(("/", os.sep))):
            # -o DIR/ makes DIR (and its parents), as quantize does; a failure removes them
            folder = made_folder(dst)
            dst = default_draft_path(src, layers, dst)  # -o DIR/: the default name there
        with terminable(), folder:
            info = make_draft(src, dst, layers, force=force)
        console = Console(emoji=False)
        # --force over a registered file: its old version dropped, its tags moved (the
        # registry kept the old digest, and `run` then refused the file as changed on disk)
        say_replaced(console, Registry().rewritten(info.path, Source("file",
                                                                     file=str(info.path))))
        console.print(
            f"wrote {info.path}\n{info.layers} of {info.source_layers} layers, "
            f"{_size(info.size_bytes)} (source {_size(src.stat().st_size)})", highlight=False,
            markup=False, soft_wrap=True)
