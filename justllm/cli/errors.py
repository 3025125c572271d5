"""Domain errors become one red line and exit code 1 at the CLI's edge."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.markup import escape

from justllm.errors import JustLLMError


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    try:
        yield
    except (JustLLMError, ValueError) as e:
        # Escaped: a message may hold brackets (`pip install 'justllm[convert]'`).
        Console(stderr=True, emoji=False).print(f"[red]error:[/red] {escape(str(e))}", highlight=False,
                                   soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        Console(stderr=True, emoji=False).print("[yellow]interrupted[/yellow]")
        raise typer.Exit(130) from None
