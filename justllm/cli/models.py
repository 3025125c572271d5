"""``justllm models`` (``ls``), ``show``, ``tag`` and ``rm``: the model registry."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from justllm.cli.errors import cli_errors
from justllm.errors import ModelLoadError

if TYPE_CHECKING:
    from justllm.models.manifest import Manifest
    from justllm.models.registry import Entry, Registry
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
        listed = plugins.listed_models()
        warn_problems(plugins)
        for problem in problems:
            Console(stderr=True, emoji=False).print(f"[yellow]skipped:[/yellow] {escape(problem)}",
                                       highlight=False, soft_wrap=True)
        console = Console(emoji=False)
        if not rows and not listed:
            console.print(f"no models in {registry.root} (justllm pull REPO[:FILE] downloads "
                          "one; justllm run/serve with no model assembles the demo model there)",
                          highlight=False, markup=False, soft_wrap=True)
            return
        _print_table(console, [_entry_row(row) for row in rows]
                     + [_listed_row(model) for _, model in listed])


def _entry_row(row: Entry) -> tuple[str, ...]:
    m = row.manifest
    here = any(f.is_file() for f in m.files)  # (a copy serves when the file is gone)
    return (row.label or "<untagged>", m.short, _size(m.size) if here else "missing",
            m.quantization, m.architecture, str(m.context_length or "?"))


def _print_table(console: Console, cells: list[tuple[str, ...]]) -> None:
    """The listing at its full width, one line per model, on a terminal or piped: rich would
    shrink a table wider than the console with '…', and a NAME or DIGEST cut so is nothing to
    copy into run, rm or tag. A terminal narrower than the table wraps its lines, as it does
    ``ollama list``'s."""
    from rich.measure import Measurement

    table = Table("NAME", "DIGEST", "SIZE", "QUANT", "ARCH", "CONTEXT", box=None,
                  pad_edge=False)
    for c in cells:
        table.add_row(*c)
    full = Measurement.get(console, console.options.update_width(1_000_000), table)
    console.width = max(console.width, full.maximum)
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
    name: Annotated[str, typer.Argument(help="NAME[:TAG] or a digest from 'justllm models', a path, demo (the bundled demo model), or a plugin's model (e.g. ollama:NAME).")],
    template: Annotated[bool, typer.Option("--template", help="Print only the chat template.")] = False,
) -> None:
    """Show a model's manifest (digest, tags, source, revision) and its GGUF metadata."""
    with cli_errors():
        from rich.markup import escape

        from justllm.models.refs import InvalidRefError
        from justllm.models.registry import Registry, UnknownModelError
        from justllm.models.source import LocalPath
        from justllm.models.store import describe

        registry = Registry()
        manifest = None
        path = LocalPath().find(name)  # an existing path wins, and a folder is refused, as in run
        if path is not None:
            title = path.name
        else:
            try:
                title, manifest = registry.resolve(name)
                path = manifest.path
            except (UnknownModelError, InvalidRefError) as e:
                path, title = _unregistered(context, name, e)
        # (describe checks the header first: a truncated or foreign file is its one line, as
        # run gives, before llama.cpp reads the metadata)
        info = describe(path)
        manifest = manifest or _manifest_of(registry, path)
        console = Console(highlight=False, emoji=False)
        if template:
            # (soft_wrap: the template's own lines, not rich's cut at 80 columns in a pipe)
            console.print(info.chat_template or "(none: the GGUF carries no chat template)",
                          markup=False, soft_wrap=True)
            return
        console.print(f"[bold]{escape(title)}[/bold]  {escape(info.metadata.get('desc', ''))}",
                      soft_wrap=True)
        if manifest is not None:
            tags = registry.labels(manifest.digest)
            console.print(f"digest: {manifest.digest}\ntags: {', '.join(tags) or '(none)'}\n"
                          f"source: {manifest.source}\nadded: {manifest.added}", markup=False,
                          soft_wrap=True)
            for origin in manifest.origins:
                again = manifest.pulled_from(origin.repo, origin.file)
                console.print(f"{'pulled again' if again else 'also pulled from'}: {origin} "
                              f"({origin.added})", markup=False, soft_wrap=True)
        console.print(f"path: {info.path}\nsize: {_size(info.size_bytes)}\n"
                      f"quantization: {info.quantization}\narchitecture: {info.architecture}\n"
                      f"context length: {info.context_length or '?'}", markup=False,
                      soft_wrap=True)
        console.print("chat template: " + ("yes (--template to print it)" if info.chat_template
                                           else "none (chats are sent as a plain 'User:/Assistant:' transcript; --chat-template chooses another)"),
                      soft_wrap=True)
        table = Table("KEY", "VALUE", box=None, pad_edge=False)
        for key in sorted(info.metadata):
            if key not in ("desc", "tokenizer.chat_template"):
                value = info.metadata[key]
                table.add_row(key, value if len(value) < 80 else value[:77] + "...")
        console.print(table)


def _manifest_of(registry: Registry, path: Path) -> Manifest | None:
    """The version of the file at ``path``. One in the models directory that no version names
    yet is adopted first, as naming it by its stem would (the demo model, named ``demo``,
    before anything listed it)."""
    from justllm.models.manifest import is_inside
    from justllm.models.refs import name_for_file

    m = registry.manifest_for_path(path)
    if m is None and is_inside(path, registry.root):
        registry.adopt(name_for_file(path.stem))
        m = registry.manifest_for_path(path)
    return m


def _unregistered(context: typer.Context, name: str,
                  error: ModelLoadError) -> tuple[Path, str]:
    """(file, title) of a model that is no registry name, found as run finds it but never
    downloaded: a relative path in the models directory, a plugin's model (ollama:NAME), the
    demo model (``demo``). None of those: that no file is there when ``name`` can only be a
    path (as run says), else ``error``, the registry's."""
    from justllm.cli.plugins import plugins_of
    from justllm.models.source import (
        PLUGIN_SCHEMES,
        DemoName,
        ModelsDirectory,
        model_not_found,
        names_a_file,
    )

    found = ModelsDirectory().find(name)
    if found is not None:
        return found, found.name
    for source in (plugins_of(context).plugin_model, DemoName().find):
        if (file := source(name)) is not None:
            return Path(file), name
    if names_a_file(name) or name.partition(":")[0] in PLUGIN_SCHEMES:
        raise model_not_found(name)  # (as run says it: show said "model file not found")
    raise error


def tag(
    context: typer.Context,
    source: Annotated[str, typer.Argument(help="A path to a .gguf file, a NAME[:TAG], a digest, or a plugin's model (e.g. ollama:NAME).")],
    target: Annotated[str, typer.Argument(help="The NAME[:TAG] to point at it (TAG: latest).")],
) -> None:
    """Name a local GGUF file, an existing version or a plugin's model (its file): NAME:TAG
    then points to it (a tag that pointed elsewhere moves; the version it left stays). A
    file is registered where it is, not copied."""
    with cli_errors():
        from justllm.cli.plugins import check_new_name, plugins_of
        from justllm.models.registry import Registry, same_file

        if not source.strip():  # (it read as the folder "." : " is a directory")
            raise ValueError("the model to tag is empty: pass a path to a .gguf file, a "
                             "NAME[:TAG] or a digest")
        check_new_name(plugins_of(context), target)
        registry = Registry()
        try:
            key, m, before = registry.tag(source, target)
        except ModelLoadError:  # not a file or a version: a plugin's model, or this error
            plugin_file = plugins_of(context).plugin_model(source)
            if plugin_file is None:
                raise
            key, m, before = registry.tag(plugin_file, target)
        moved = f" (moved from sha256:{before.short}, which is kept)" if before else ""
        file = Path(source).expanduser().absolute()
        if file.is_file() and not same_file(file, m.path):  # FILE's bytes were registered
            moved += f" (registered there already; {file}, the same bytes, is kept as its " \
                     "copy, used if that file goes or changes)"
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
        from justllm.models.registry import Registry, UnknownModelError

        registry = Registry()
        try:
            r = registry.remove(ref)
        except ModelLoadError as e:
            plugin_file = plugins_of(context).plugin_model(ref)
            if plugin_file is not None:
                raise ModelLoadError(f"{ref} is a plugin's model ({plugin_file}), not in "
                                     "justllm's registry: remove it with the tool that stored "
                                     "it") from None
            if isinstance(e, UnknownModelError) and ref.strip().lower() == "demo":
                raise _demo_is_no_name(registry) from None
            raise
        console = Console(highlight=False, emoji=False)
        if r.manifest is None:
            console.print(f"untagged {r.what} (it pointed to no version)", markup=False,
                          soft_wrap=True)
            return
        version = f"sha256:{r.manifest.short}"
        if r.still_tagged:
            # soft_wrap: one line in a pipe (rich cut it at 80 columns, a tag in two)
            console.print(f"untagged {r.what}; its version {version} is still "
                          f"{', '.join(r.still_tagged)}", markup=False, soft_wrap=True)
            return
        what = (f"version {version}" + (f" (untagged {', '.join(r.untagged)})" if r.untagged else "")
                if r.what == r.manifest.digest else f"{r.what} and its version {version}")
        file = (f"; deleted {r.deleted_file}" if r.deleted_file else
                f"; kept {r.kept_file} ({r.kept_because})" if r.kept_file else "")
        console.print(f"removed {what}{file}", markup=False, soft_wrap=True)


def _demo_is_no_name(registry: Registry) -> ModelLoadError:
    """``rm demo``: ``demo`` is what run, serve and show call the bundled demo model, not one
    of its registry names (removing every name on its version by that word would be a
    surprise); the error gives the name that removes it."""
    from justllm.models.source import demo_file

    file = demo_file()
    m = _manifest_of(registry, file) if file is not None and file.is_file() else None
    if m is None:
        return ModelLoadError("'demo' names the bundled demo model, which is not in the models "
                              "directory: nothing to remove")
    tags = registry.labels(m.digest)
    name = tags[0] if len(tags) == 1 else f"sha256:{m.short}"  # (the version, every tag on it)
    return ModelLoadError(f"'demo' names the bundled demo model, not a tag: 'justllm rm "
                          f"{name}' removes it (run or serve with no model assembles it again)")
