"""The ``justllm`` command line: one module per command group, registered here."""

from __future__ import annotations

import typer

from justllm.cli import run as run_cmd
from justllm.cli import serve as serve_cmd

app = typer.Typer(
    name="justllm",
    help="Serve GGUF language models from one command.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)
app.command("run")(run_cmd.run)
app.command("serve")(serve_cmd.serve)


@app.callback()
def _root() -> None:
    """Serve GGUF language models from one command."""


def main() -> None:
    app()
