"""``justllm pull``: download a GGUF from a Hugging Face repo into the local models directory."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from justllm.cli.errors import cli_errors
from justllm.models.hub import pick_gguf, split_ref  # noqa: F401  (re-exported for callers and tests)


def pull(
    model: Annotated[str, typer.Argument(
        help="REPO or REPO:FILE on the Hugging Face Hub, e.g. "
             "bartowski/Qwen2.5-0.5B-Instruct-GGUF:Qwen2.5-0.5B-Instruct-Q4_K_M.gguf.")],
    revision: Annotated[str, typer.Option("--revision", help="Branch, tag or commit.")] = "main",
    force: Annotated[bool, typer.Option("--force", help="Download again even if the local copy is up to date.")] = False,
) -> None:
    """Download a GGUF model from Hugging Face into the models directory (REPO alone picks its
    only .gguf file, or its Q4_K_M one; HF_ENDPOINT and HF_TOKEN are honoured)."""
    with cli_errors():
        from justllm.models.hub import pull_model

        pull_model(model, revision=revision, force=force, console=Console())
