"""``justllm plugins``, and how commands get the plugins ``main()`` loaded."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from justllm.cli.errors import cli_errors
from justllm.plugins import Plugins, load_plugins


def plugins_of(context: typer.Context | None) -> Plugins:
    """The plugins ``main()`` loaded (or a test passed as ``obj``); loaded now otherwise."""
    found = context.find_object(Plugins) if context is not None else None
    return found if found is not None else load_plugins()


def check_new_name(plugins: Plugins, name: str | None) -> None:
    """ValueError when a plugin's model source reads the NAME[:TAG] about to be made
    (``tag``, ``pull --tag``, ``convert --name``) as one of its models: ``run`` and ``serve``
    ask that plugin first, so ``tag x ollama:foo`` made a name that ``show`` and ``rm`` read
    as the tag and ``run`` as Ollama's model."""
    from justllm.models.refs import label, new_ref

    if name is None:
        return
    key = label(*new_ref(name))
    if plugins.claims(key):
        raise ValueError(f"'{key}' names a plugin's model ({key.partition(':')[0]}:NAME): "
                         "pick another name")


def warn_problems(plugins: Plugins) -> None:
    """Print the plugins' problems not printed yet, one yellow line each, on stderr (main()
    prints the loading ones, a command those its own work found, and main() again, at the
    end, any found later, such as a model source that failed)."""
    console = Console(stderr=True, emoji=False)
    for line in plugins.problems[plugins.shown:]:
        console.print(f"[yellow]warning:[/yellow] {escape(line)}", highlight=False,
                      soft_wrap=True)
    plugins.shown = len(plugins.problems)


def list_plugins(
    context: typer.Context,
    all_: Annotated[bool, typer.Option("--all", help="Include justllm's built-in plugin (its model sources, speculation methods and routing policies).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON: a list of {name, version, hooks}.")] = False,
) -> None:
    """List the installed plugins that are loaded, their versions and the hooks they implement,
    and any problem with what they register. JUSTLLM_PLUGINS (a comma list of names, or empty
    for none) chooses which are loaded."""
    with cli_errors():
        plugins = plugins_of(context)
        plugins.model_sources(), plugins.spec_methods, plugins.routing_policies  # noqa: B018
        plugins.routes()
        warn_problems(plugins)
        infos = plugins.info(include_builtin=all_)
        if as_json:
            print(json.dumps([{"name": p.name, "version": p.version, "hooks": list(p.hooks)}
                              for p in infos], indent=2))
            return
        console = Console(emoji=False)
        if not infos:
            console.print("no plugins loaded (JUSTLLM_PLUGINS chooses them; see "
                          "plugins/README.md to write one)", highlight=False, soft_wrap=True)
            return
        table = Table("NAME", "VERSION", "HOOKS", box=None, pad_edge=False)
        for p in infos:
            table.add_row(escape(p.name), escape(p.version or "-"), ", ".join(p.hooks))
        console.print(table, highlight=False)
