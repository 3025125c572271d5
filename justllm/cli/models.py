"""``justllm models`` (``ls``), ``show`` and ``rm``: the local models directory."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from justllm.cli.errors import cli_errors


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def list_models() -> None:
    """List local models with size, quantization, architecture and context length."""
    with cli_errors():
        from justllm.models.store import ModelStore, describe

        store = ModelStore()
        paths = store.paths()
        console = Console()
        if not paths:
            console.print(f"no models in {store.root} (justllm run/serve with no model "
                          "assembles the demo model there)", highlight=False)
            return
        table = Table("NAME", "SIZE", "QUANT", "ARCH", "CONTEXT", box=None, pad_edge=False)
        for path in paths:
            info = describe(path)
            table.add_row(info.name, _size(info.size_bytes), info.quantization,
                          info.architecture, str(info.context_length or "?"))
        console.print(table)


def show(
    name: Annotated[str, typer.Argument(help="A model name from 'justllm models', or a path.")],
    template: Annotated[bool, typer.Option("--template", help="Print only the chat template.")] = False,
) -> None:
    """Show a model's GGUF metadata and chat template."""
    with cli_errors():
        from pathlib import Path

        from justllm.models.store import ModelStore, describe

        path = Path(name) if Path(name).is_file() else ModelStore().require(name)
        info = describe(path)
        console = Console()
        if template:
            console.print(info.chat_template or "(none: the GGUF carries no chat template)",
                          markup=False, highlight=False)
            return
        console.print(f"[bold]{info.name}[/bold]  {info.metadata.get('desc', '')}", highlight=False)
        console.print(f"path: {info.path}\nsize: {_size(info.size_bytes)}\n"
                      f"quantization: {info.quantization}\narchitecture: {info.architecture}\n"
                      f"context length: {info.context_length or '?'}", highlight=False)
        console.print("chat template: " + ("yes (--template to print it)" if info.chat_template
                                           else "none (justllm uses the family's default)"),
                      highlight=False)
        table = Table("KEY", "VALUE", box=None, pad_edge=False)
        for key in sorted(info.metadata):
            if key not in ("desc", "tokenizer.chat_template"):
                value = info.metadata[key]
                table.add_row(key, value if len(value) < 80 else value[:77] + "...")
        console.print(table)


def rm(
    name: Annotated[str, typer.Argument(help="A model name from 'justllm models'.")],
) -> None:
    """Delete a local model file."""
    with cli_errors():
        from justllm.models.store import ModelStore

        path = ModelStore().remove(name)
        Console().print(f"deleted {path}", highlight=False)
