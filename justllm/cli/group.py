"""The command group every justllm Typer app uses."""

from __future__ import annotations

import inspect
from typing import Any

from typer.core import TyperGroup


class OneLineSummaries(TyperGroup):
    """A group whose command list shows each command's first docstring paragraph as one
    paragraph. Typer's rich help keeps the docstring's line breaks there (only its markdown mode
    joins them, and that mode swallows ``<stem>``-style placeholders), so wrapped docstrings
    came out broken mid-sentence."""

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None and command.short_help is None and command.help:
            first = inspect.cleandoc(command.help).split("\n\n")[0]
            command.short_help = " ".join(first.split())
        return command
