"""Shell completion of option values: the words an option takes, offered after it (Typer
offered files, or nothing, after ``--flash-attn`` or ``quantize MODEL``). A value list that
needs a heavier import is read only when a shell asks."""

from __future__ import annotations

from collections.abc import Callable, Collection

import typer


def one_of(values: Callable[[], Collection[str]]) -> Callable[[str], list[str]]:
    """Completion for an option that takes one of ``values()``: those that start with what is
    typed."""
    def complete(incomplete: str) -> list[str]:
        return [v for v in values() if v.startswith(incomplete)]
    return complete


def spec_methods(ctx: typer.Context, incomplete: str) -> list[str]:
    """``--spec``: justllm's methods and the loaded plugins'."""
    from justllm.cli.plugins import plugins_of

    return [m for m in plugins_of(ctx).spec_methods if m.startswith(incomplete)]


def chat_templates() -> Collection[str]:
    from justllm.engine.chat_template import BUILTIN_TEMPLATES

    return BUILTIN_TEMPLATES


def quant_types() -> Collection[str]:
    from justllm.models.quantize import QUANT_TYPES

    return [t.name for t in QUANT_TYPES]


def outtypes() -> Collection[str]:
    from justllm.models.convert import OUTTYPES

    return OUTTYPES


def roles() -> Collection[str]:
    from justllm.server.pd import ROLES

    return ROLES
