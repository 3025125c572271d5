"""``justllm config show``: the defaults ``serve`` and ``run`` would use, and where each comes from."""

from __future__ import annotations

import os
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from justllm.cli.errors import cli_errors
from justllm.cli.group import OneLineSummaries

app = typer.Typer(help="Show configuration.", no_args_is_help=True,
                  cls=OneLineSummaries, context_settings={"help_option_names": ["-h", "--help"]})


@app.command("show")
def show(
    context: typer.Context,
    config_file: Annotated[Optional[str], typer.Option("--config", envvar="JUSTLLM_CONFIG", help="YAML file of defaults.")] = None,
) -> None:
    """Print every serve option's value with its source: cli default, environment, or file,
    and check the values as serve would. Precedence: command line > environment (JUSTLLM_*) >
    file > built-in default."""
    with cli_errors():
        from justllm.cli.options import (
            ENGINE_FLAGS,
            all_option_names,
            check_engine_values,
            check_serve_values,
            default_config_file,
            file_value,
            option_name,
            read_config_file,
        )
        from justllm.cli.plugins import plugins_of
        from justllm.cli.serve import gateway_config, serve
        from justllm.errors import JustLLMError

        file_values: dict[str, tuple[str, object]] = {}
        if not config_file and default_config_file().is_file():
            config_file = str(default_config_file())
        if config_file:  # keyed by option name, as serve reads it (cli/options.py)
            file_values = read_config_file(config_file)
        # One file serves every command: serve passes over the keys only another one takes.
        # An unknown one is a mistake in the file: said before any table (as every command).
        others = all_option_names(context)
        unknown = [key for name, (key, _) in file_values.items()
                   if name not in others or name == "config"]
        if unknown:
            raise ValueError(f"{config_file}: unknown option(s) {', '.join(sorted(unknown))}")
        command = typer.main.get_command(_single(serve))
        table = Table("OPTION", "VALUE", "SOURCE", box=None, pad_edge=False)
        ctx = command.context_class(command)
        bad: list[str] = []
        engine = {f.name: f.default for f in ENGINE_FLAGS}
        values: dict[str, Any] = {}  # serve's own options, as serve would get them
        for param in command.params:
            name = option_name(param)
            if (not name or name == "config" or param.name in ("install_completion",
                                                               "show_completion")):
                continue  # serve's MODELs and the shell-completion helpers are no settings
            envvar = param.envvar if isinstance(param.envvar, str) else None
            value: object
            if envvar and envvar in os.environ:
                # (an option given several times, such as --lora, splits its variable as
                # click does for serve: the raw string was refused as no iterable)
                split = getattr(param, "multiple", False) or getattr(param, "nargs", 1) != 1
                value = param.value_from_envvar(ctx) if split else os.environ[envvar]
                source = f"env {envvar}"
                file_values.pop(name, None)  # known, and overridden
            elif name in file_values:
                value, source = file_value(param, file_values.pop(name)[1]), "file"
            else:
                value, source = param.default, "default"
            values[str(param.name)] = param.default
            if source != "default" and value is not None:
                try:  # what serve would refuse is said here too
                    converted = param.process_value(ctx, value)
                    values[str(param.name)] = converted
                    if param.name in engine:
                        engine[str(param.name)] = converted
                except typer.BadParameter as e:
                    bad.append(f"{param.opts[0]} ({source}): {e.message}")
            if param.name == "api_key" and value:
                value = "***"
            table.add_row(param.opts[0], str(value), source)
        Console(emoji=False).print(table)
        if not bad:  # serve's own checks, then router mode's or the engine's, with serve's code
            try:
                check_serve_values(
                    port=values["port"], shutdown_timeout=values["shutdown_timeout"],
                    role=values["role"], served_model_name=values["served_model_name"],
                    models_file=values["models_file"], models_dir=values["models_dir"],
                    host=values["host"], api_key=values["api_key"])
                plugins = plugins_of(context)
                if values["models_file"] or values["models_dir"]:
                    # the models file or folder read and every model checked, as serve does
                    # (each model's entry wins over these values: they are checked in it)
                    gateway_config([], values["models_file"], values["models_dir"], engine,
                                   plugins)
                else:  # one model, which config show does not know: all the rest
                    check_engine_values(engine, plugins.spec_methods)
            except (ValueError, JustLLMError) as e:
                bad.append(str(e))
        if bad:
            raise ValueError("invalid: " + "; ".join(bad))


def _single(fn):
    one = typer.Typer()
    one.command()(fn)
    return one
