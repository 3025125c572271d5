"""``justllm models`` (``ls``), ``show``, ``tag`` and ``rm``: the model registry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from justllm.cli.errors import cli_errors

if TYPE_CHECKING:
    from justllm.models.source import ListedModel


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def list_models(context: typer.Context) -> None:
    """List local models: NAME:TAG, digest, size, quantization, architecture, context length.

    A version with several tags has a row for each; a version no tag points to any more shows
    as <untagged> until 'justllm rm DIGEST'. GGUF files put into the models directory by hand
    appear as STEM:latest. Plugins' model sources list theirs too (e.g. ollama:NAME)."""
    with cli_errors():
        from rich.markup import escape

        from justllm.cli.plugins import plugins_of, warn_problems
        from justllm.models.registry import Registry

        registry = Registry()
        rows, problems = registry.entries()
        plugins = plugins_of(context)
        seen = len(plugins.problems)
        listed = plugins.listed_models()
        warn_problems(plugins, seen)
        for problem in problems:
            Console(stderr=True, emoji=False).print(f"[yellow]skipped:[/yellow] {escape(problem)}",
                                       highlight=False, soft_wrap=True)
        console = Console(emoji=False)
        if not rows and not listed:
            console.print(f"no models in {registry.root} (justllm pull REPO[:FILE] downloads "
                          "one; justllm run/serve with no model assembles the demo model there)",
                          highlight=False)
            return
        table = Table("NAME", "DIGEST", "SIZE", "QUANT", "ARCH", "CONTEXT", box=None,
                      pad_edge=False)
        for row in rows:
            m = row.manifest
            table.add_row(row.label or "<untagged>", m.short,
                          _size(m.size) if m.path.is_file() else "missing", m.quantization,
                          m.architecture, str(m.context_length or "?"))
        for _, model in listed:
            table.add_row(*_listed_row(model))
        console.print(table, highlight=False)


def _listed_row(model: ListedModel) -> tuple[str, ...]:
    """A plugin source's model: no registry digest; the rest from its GGUF header."""
    from rich.markup import escape

    from justllm.errors import JustLLMError
    from justllm.models.store import describe

    try:
        info = describe(model.path)
    except (JustLLMError, OSError) as e:
        return escape(model.name), "-", "?", "?", f"unreadable: {escape(str(e))}", "?"
    return (escape(model.name), "-", _size(info.size_bytes), info.quantization,
            info.architecture, str(info.context_length or "?"))


def show(
    context: typer.Context,
    name: Annotated[str, typer.Argument(help="NAME[:TAG] or a digest from 'justllm models', a path, or a plugin's model (e.g. ollama:NAME).")],
    template: Annotated[bool, typer.Option("--template", help="Print only the chat template.")] = False,
) -> None:
    """Show a model's manifest (digest, tags, source, revision) and its GGUF metadata."""
    with cli_errors():
        from pathlib import Path

        from justllm.cli.plugins import plugins_of
        from justllm.models.refs import InvalidRefError
        from justllm.models.registry import Registry, UnknownModelError
        from justllm.models.store import ModelStore, describe

        registry = Registry()
        path = Path(name).expanduser()
        if path.is_file():
            manifest, title = registry.manifest_for_path(path), path.name
        else:
            try:
                title, manifest = registry.resolve(name)
                path = manifest.path
            except (UnknownModelError, InvalidRefError):
                found = ModelStore().find(name)  # a relative path in the models directory
                if found is not None:
                    path, title = found, found.name
                else:  # a plugin's source (ollama:NAME), or the registry's error
                    plugin_file = plugins_of(context).plugin_model(name)
                    if plugin_file is None:
                        raise
                    path, title = Path(plugin_file), name
                manifest = registry.manifest_for_path(path)
        info = describe(path)
        console = Console(highlight=False, emoji=False)
        if template:
            console.print(info.chat_template or "(none: the GGUF carries no chat template)",
                          markup=False)
            return
        console.print(f"[bold]{title}[/bold]  {info.metadata.get('desc', '')}")
        if manifest is not None:
            tags = registry.labels(manifest.digest)
            console.print(f"digest: {manifest.digest}\ntags: {', '.join(tags) or '(none)'}\n"
                          f"source: {manifest.source}\nadded: {manifest.added}", markup=False)
        console.print(f"path: {info.path}\nsize: {_size(info.size_bytes)}\n"
                      f"quantization: {info.quantization}\narchitecture: {info.architecture}\n"
                      f"context length: {info.context_length or '?'}", markup=False)
        console.print("chat template: " + ("yes (--template to print it)" if info.chat_template
                                           else "none (chats are sent as a plain 'User:/Assistant:' transcript; --chat-template chooses another)"))
        table = Table("KEY", "VALUE", box=None, pad_edge=False)
        for key in sorted(info.metadata):
            if key not in ("desc", "tokenizer.chat_template"):
                value = info.metadata[key]
                table.add_row(key, value if len(value) < 80 else value[:77] + "...")
        console.print(table)


def tag(
    context: typer.Context,
    source: Annotated[str, typer.Argument(help="A path to a .gguf file, a NAME[:TAG], a digest, or a plugin's model (e.g. ollama:NAME).")],
    target: Annotated[str, typer.Argument(help="The NAME[:TAG] to point at it (TAG: latest).")],
) -> None:
    """Name a local GGUF file, an existing version or a plugin's model (its file): NAME:TAG
    then points to it (a tag that pointed elsewhere moves; the version it left stays). A
    file is registered where it is, not copied."""
    with cli_errors():
        from justllm.cli.plugins import plugins_of
        from justllm.errors import ModelLoadError
        from justllm.models.registry import Registry

        registry = Registry()
        try:
            key, m, before = registry.tag(source, target)
        except ModelLoadError:  # not a file or a version: a plugin's model, or this error
            plugin_file = plugins_of(context).plugin_model(source)
            if plugin_file is None:
                raise
            key, m, before = registry.tag(plugin_file, target)
        moved = f" (moved from sha256:{before.short}, which is kept)" if before else ""
        Console(highlight=False, emoji=False).print(f"{key} -> {m.digest[:19]} {m.path}{moved}",
                                       markup=False, soft_wrap=True)


def rm(
    context: typer.Context,
    ref: Annotated[str, typer.Argument(help="NAME[:TAG] or a digest from 'justllm models'.")],
) -> None:
    """Remove a tag, or a version by its digest (with every tag on it). A version no tag points
    to any more goes, and its file too when it lives in the models directory. A version a
    running model holds is refused. A plugin's model (ollama:NAME) is not justllm's to remove."""
    with cli_errors():
        from justllm.cli.plugins import plugins_of
        from justllm.errors import ModelLoadError
        from justllm.models.registry import Registry

        try:
            r = Registry().remove(ref)
        except ModelLoadError:
            plugin_file = plugins_of(context).plugin_model(ref)
            if plugin_file is None:
                raise
            raise ModelLoadError(f"{ref} is a plugin's model ({plugin_file}), not in justllm's "
                                 "registry: remove it with the tool that stored it") from None
        console = Console(highlight=False, emoji=False)
        if r.manifest is None:
            console.print(f"untagged {r.what} (it pointed to no version)", markup=False)
            return
        version = f"sha256:{r.manifest.short}"
        if r.still_tagged:
            console.print(f"untagged {r.what}; its version {version} is still "
                          f"{', '.join(r.still_tagged)}", markup=False)
            return
        what = (f"version {version}" + (f" (untagged {', '.join(r.untagged)})" if r.untagged else "")
                if r.what == r.manifest.digest else f"{r.what} and its version {version}")
        file = (f"; deleted {r.deleted_file}" if r.deleted_file else
                f"; kept {r.kept_file} ({r.kept_because})" if r.kept_file else "")
        console.print(f"removed {what}{file}", markup=False, soft_wrap=True)
