"""The checked-in shell completions are what completions/generate.py writes from the CLI now,
and what they run offers only real candidates."""

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("completions_generate",
                                                  ROOT / "completions" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completions_are_current(shell):
    assert _generator().script(shell) == (ROOT / "completions" / f"justllm.{shell}").read_text(), (
        f"completions/justllm.{shell} is stale: regenerate it (see completions/README.md)")


def _complete(shell: str, words: str, columns: str) -> str:
    """What the checked-in script for ``shell`` (zsh or fish) gets from justllm for the
    command line ``words``, in a terminal ``columns`` wide: its ``(env VAR=... justllm)``
    command run as the shell would run it."""
    script = (ROOT / "completions" / f"justllm.{shell}").read_text()
    command = script.split("(env ", 1)[1].split(" justllm)", 1)[0]
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    env["COLUMNS"] = columns
    for assignment in shlex.split(command.replace("(commandline -cp)", "WORDS")):
        name, _, value = assignment.partition("=")
        env[name] = words if value in ("WORDS", "${words[1,$CURRENT]}") else value
    out = subprocess.run([sys.executable, "-c", "import sys; sys.argv[0] = 'justllm'; "
                          "from justllm.cli import main; main()"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _fish_candidates(words: str, columns: str) -> list[str]:
    """Each line fish reads is a candidate of its own (its help after a tab)."""
    return [line.split("\t", 1)[0] for line in _complete("fish", words, columns).splitlines()]


@pytest.mark.parametrize("columns", ["40", "80"])
def test_fish_offers_the_commands_and_nothing_else(columns):
    """Typer renders each candidate's help at the terminal's width; a wrapped help's further
    lines were candidates of their own ("in its own process." for `justllm `: 28 of them)."""
    import typer

    from justllm.cli import app

    group = typer.main.get_command(app)
    commands = [name for name in group.commands if not group.commands[name].hidden]
    assert "serve" in commands and "ls" not in commands
    assert _fish_candidates("justllm ", columns) == commands
    options = _fish_candidates("justllm serve --", columns)
    assert len(options) > 20 and all(o.startswith("--") for o in options), options


def test_zsh_descriptions_are_one_line_each():
    """zsh reads ``_arguments '*: :(("value":"description" ...))'``, one candidate a line."""
    out = _complete("zsh", "justllm serve --", "80").splitlines()
    assert out[0].startswith("_arguments '*: :((") and out[-1].endswith("))'"), out[:2]
    lines = [out[0].removeprefix("_arguments '*: :(("), *out[1:]]
    assert len(lines) > 20 and all(line.startswith('"--') for line in lines), lines


def test_an_option_that_takes_one_of_some_words_offers_them():
    """`--flash-attn <TAB>` offered nothing (fish) or the folder's files (bash, zsh), though
    it takes auto, on or off; so did `quantize MODEL <TAB>` for llama.cpp's types."""
    assert _fish_candidates("justllm serve --flash-attn ", "80") == ["auto", "on", "off"]
    assert _fish_candidates("justllm quantize demo Q4_K", "80") == ["Q4_K", "Q4_K_S", "Q4_K_M"]
