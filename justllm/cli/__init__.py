"""The ``justllm`` command line: one module per command group, registered here."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Annotated, Any

import typer

from justllm.cli import bench as bench_cmd
from justllm.cli import chat as chat_cmd
from justllm.cli import cluster as cluster_cmd
from justllm.cli import config as config_cmd
from justllm.cli import convert as convert_cmd
from justllm.cli import draft as draft_cmd
from justllm.cli import models as models_cmd
from justllm.cli import plugins as plugins_cmd
from justllm.cli import ps as ps_cmd
from justllm.cli import pull as pull_cmd
from justllm.cli import quantize as quantize_cmd
from justllm.cli import run as run_cmd
from justllm.cli import serve as serve_cmd
from justllm.cli import top as top_cmd
from justllm.cli.group import OneLineSummaries
from justllm.plugins import Plugins, load_plugins


def build_app(plugins: Plugins | None = None) -> typer.Typer:
    """The command line: the built-in commands, and ``plugins``' (register_commands)."""
    app = typer.Typer(
        name="justllm",
        help="Serve GGUF language models from one command.",
        context_settings={"help_option_names": ["-h", "--help"]},
        no_args_is_help=True,
        add_completion=True,
        pretty_exceptions_enable=False,
        cls=OneLineSummaries,
    )
    app.command("run")(run_cmd.run)
    app.command("serve")(serve_cmd.serve)
    app.command("chat")(chat_cmd.chat)
    app.command("bench")(bench_cmd.bench)
    app.command("top")(top_cmd.top)
    app.command("ps")(ps_cmd.ps)
    app.command("logs")(ps_cmd.logs)
    app.command("models")(models_cmd.list_models)
    app.command("ls", hidden=True)(models_cmd.list_models)  # alias
    app.command("pull")(pull_cmd.pull)
    app.command("show")(models_cmd.show)
    app.command("tag")(models_cmd.tag)
    app.command("rm")(models_cmd.rm)
    app.command("quantize")(quantize_cmd.quantize)
    app.command("convert")(convert_cmd.convert)
    app.command("plugins")(plugins_cmd.list_plugins)
    app.add_typer(config_cmd.app, name="config")
    app.add_typer(draft_cmd.app, name="draft")
    app.add_typer(cluster_cmd.app, name="cluster")

    @app.callback()
    def _root(version: Annotated[bool, typer.Option(
            "--version", "-v", callback=_print_version, is_eager=True,
            help="Print justllm's version (and llama-cpp-python's) and exit.")] = False) -> None:
        """Serve GGUF language models from one command."""

    if plugins is not None:
        plugins.add_commands(app)
    return app


def _print_version(value: bool) -> None:
    """``--version``, as ``ollama -v`` and ``llama-server --version``: read from the installed
    packages' metadata, without loading llama.cpp."""
    if not value:
        return
    from justllm import build_info

    print(build_info())
    raise typer.Exit()


# The built-in commands, for Typer's CliRunner in tests (which may pass a Plugins as ``obj``);
# main() builds the command line with the installed plugins' commands.
app = build_app()


def _run_and_warn(cli: Any, plugins: Any) -> Any:
    """The command, then any plugin problem it found that it did not print itself (a model
    source that failed while a name was looked up)."""
    try:
        return cli(standalone_mode=False, obj=plugins)
    finally:
        plugins_cmd.warn_problems(plugins)


def main() -> None:
    """The console script: usage errors too become one red line and exit code 1."""
    from rich.console import Console
    from rich.markup import escape

    # Typer vendors click; its exception base class is reachable only through a public one.
    click_exception: Any = next(
        c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    plugins = load_plugins()  # a plugin that fails to load is one warning line, and skipped
    cli = build_app(plugins)
    plugins_cmd.warn_problems(plugins)
    try:
        code = _run_and_warn(cli, plugins)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except BrokenPipeError:  # the reader left (| head): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        sys.exit(1)
    except OSError as e:  # the system refused what a command did (a full disk)
        with contextlib.suppress(OSError):
            Console(stderr=True, emoji=False).print(
                f"[red]error:[/red] {escape(e.strerror or str(e))}"
                + (f": {escape(str(e.filename))}" if e.filename else ""),
                highlight=False, soft_wrap=True)
        sys.exit(1)
    except click_exception as e:
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
            # Its message is the help; Typer's rich formatter already printed it while making
            # it (and left the message empty), so print only what is left to print.
            if e.format_message():
                print(e.format_message())
            sys.exit(0)
        Console(stderr=True, emoji=False).print(f"[red]error:[/red] {e.format_message()}", highlight=False,
                                   soft_wrap=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
