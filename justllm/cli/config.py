"""``justllm config show``: the defaults ``serve`` and ``run`` would use, and where each comes from."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from justllm.cli.errors import cli_errors
from justllm.cli.group import OneLineSummaries

app = typer.Typer(help="Show configuration.", no_args_is_help=True,
                  cls=OneLineSummaries, context_settings={"help_option_names": ["-h", "--help"]})


@app.command("show")
def show(
    config_file: Annotated[Optional[str], typer.Option("--config", envvar="JUSTLLM_CONFIG", help="YAML file of defaults.")] = None,
) -> None:
    """Print every serve option's value with its source: cli default, environment, or file.
    Precedence: command line > environment (JUSTLLM_*) > file > built-in default."""
    with cli_errors():
        from justllm.cli.options import ENGINE_FLAGS, config_values, default_config_file
        from justllm.cli.serve import serve
        from justllm.config import EngineConfig, read_yaml
        from justllm.plugins import load_plugins

        file_values: dict[str, object] = {}
        if not config_file and default_config_file().is_file():
            config_file = str(default_config_file())
        if config_file:
            data = read_yaml(config_file) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{config_file} must hold a mapping of option names to values")
            file_values = {str(k).replace("-", "_"): v for k, v in data.items()}
        command = typer.main.get_command(_single(serve))
        table = Table("OPTION", "VALUE", "SOURCE", box=None, pad_edge=False)
        ctx = command.context_class(command)
        bad: list[str] = []
        engine = {f.name: f.default for f in ENGINE_FLAGS}
        for param in command.params:
            if (param.name in ("models", "config_file", "install_completion",
                               "show_completion") or not param.opts):
                continue  # serve's MODELs and the shell-completion helpers are no settings
            envvar = param.envvar if isinstance(param.envvar, str) else None
            value: object
            if envvar and envvar in os.environ:
                value, source = os.environ[envvar], f"env {envvar}"
                file_values.pop(param.name, None)  # known, and overridden
            elif param.name in file_values:
                value, source = file_values.pop(param.name), "file"
            else:
                value, source = param.default, "default"
            if source != "default" and value is not None:
                try:  # what serve would refuse is said here too
                    converted = param.process_value(ctx, value)
                    if param.name in engine:
                        engine[param.name] = converted
                except typer.BadParameter as e:
                    bad.append(f"{param.opts[0]} ({source}): {e.message}")
            if param.name == "api_key" and value:
                value = "***"
            table.add_row(param.opts[0], str(value), source)
        Console(emoji=False).print(table)
        if file_values:
            raise ValueError(f"{config_file}: unknown option(s) {', '.join(sorted(file_values))}")
        if not bad:  # the engine's own checks, as serve and run make them (ranges, choices)
            try:
                EngineConfig(model="", spec_methods=load_plugins().spec_methods,
                             **config_values(engine) | {"lora": ()})
            except ValueError as e:
                bad.append(str(e))
        if bad:
            raise ValueError("invalid: " + "; ".join(bad))


def _single(fn):
    one = typer.Typer()
    one.command()(fn)
    return one
