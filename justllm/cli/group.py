"""The command group every justllm Typer app uses."""

from __future__ import annotations

import inspect
from typing import Any

from typer.core import TyperGroup


class OneLineSummaries(TyperGroup):
    """A group whose commands' help shows each docstring paragraph as one paragraph, in the
    group's command list and in the command's own ``--help``. Typer's rich help keeps a
    docstring's line breaks (only its markdown mode joins them, and that mode swallows
    ``<stem>``-style placeholders), so wrapped docstrings came out broken mid-sentence. A
    paragraph that starts with click's ``\\b`` keeps its lines.

    Its parameters read alike too: arguments in capitals (Typer writes ``{model}`` beside
    metavars such as ``TYPE``), and flags without a ``<bool>`` value they do not take."""

    def get_params(self, ctx: Any) -> Any:
        return _tidy(super().get_params(ctx))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None and not hasattr(command, "list_commands"):
            _tidy(command.get_params(ctx))
        if command is not None and command.help and command.short_help is None:
            paragraphs = [p if p.startswith("\b") else " ".join(p.split())
                          for p in inspect.cleandoc(command.help).split("\n\n")]
            command.help = "\n\n".join(paragraphs)
            command.short_help = paragraphs[0]
        return command


def _tidy(params: Any) -> Any:
    for param in params:
        if param.metavar is None:
            if param.param_type_name == "argument":
                param.metavar = param.name.upper()
            elif getattr(param, "is_flag", False) and not getattr(param, "count", False):
                param.metavar = ""
    return params
