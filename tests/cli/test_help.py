"""Help text: what ``--help`` shows is what the code says, unbroken and unswallowed."""

import typer
import typer.testing
from rich.text import Text

from justllm.cli import build_app
from justllm.plugins import load_plugins


def _walk(cmd, ctx):
    """Every command under ``cmd`` (Typer's own vendored click types: no isinstance)."""
    yield cmd, ctx
    if hasattr(cmd, "list_commands"):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            yield from _walk(sub, sub.context_class(sub, info_name=name, parent=ctx))


def _every_command():
    root = typer.main.get_command(build_app(load_plugins()))  # the installed plugins' too
    return list(_walk(root, root.context_class(root, info_name="justllm")))


def test_the_command_lists_show_each_summary_as_one_paragraph():
    """Typer's rich help kept a docstring's line breaks in a group's command list and in a
    command's own help, so a wrapped docstring came out broken mid-sentence ('--models' alone
    on a line)."""
    import inspect

    from justllm.cli import models

    assert "\n" in inspect.cleandoc(models.list_models.__doc__).split("\n\n")[1]  # wrapped
    helped = [c for c, _ in _every_command() if c.help and c.short_help]
    assert len(helped) > 20
    for cmd in helped:
        assert "\n" not in cmd.short_help and cmd.short_help.startswith(cmd.help.split()[0])
        assert all("\n" not in p for p in cmd.help.split("\n\n")), cmd.name
    out = typer.testing.CliRunner().invoke(build_app(), ["--help"], env={"COLUMNS": "300"}).output
    assert "Several MODELs, --models or --models-dir: router mode" in out


def test_no_help_text_loses_a_bracketed_word_to_rich_markup():
    """Rich reads '[demo]' as a style tag and drops it: 'justllm[demo]' showed as 'justllm'.
    A bracket that is text must be escaped (\\[)."""
    texts = []
    for cmd, _ in _every_command():
        texts += [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
    assert any("\\[" in t for t in texts)  # the escaped ones are among those checked
    for t in texts:
        assert Text.from_markup(t).plain == t.replace("\\[", "["), t


def test_arguments_read_in_capitals_and_flags_show_no_value():
    """Usage lines mixed '{model}' with 'TYPE' and 'MODEL', and every flag showed a '<bool>'
    value that it does not take."""
    runner = typer.testing.CliRunner()
    app = build_app()
    out = runner.invoke(app, ["quantize", "--help"], env={"COLUMNS": "200"}).output
    assert "Usage: justllm quantize [OPTIONS] [MODEL] [TYPE]" in out
    assert "<bool>" not in out and "--force" in out and "<int>" in out  # valued options keep theirs
    out = runner.invoke(app, ["draft", "make", "--help"], env={"COLUMNS": "200"}).output
    assert "{MODEL}" in out and "<bool>" not in out
    out = runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    assert "<bool>" not in out and "--help" in out
    for cmd, ctx in _every_command():
        for p in cmd.get_params(ctx):
            if p.param_type_name == "argument":
                assert p.metavar and p.metavar.isupper(), (cmd.name, p.name)


def test_every_option_is_in_the_readme():
    """Each command's options are named in README.md (a plugin's commands: in the plugin's own
    README); `plugins --all`, `logs --follow`/`--lines` and `run --prompt` were in no README."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    docs = "\n".join(p.read_text() for p in [root / "README.md",
                                             *root.glob("plugins/*/README.md")])
    typer_own = {"--help", "--install-completion", "--show-completion"}
    options = {(cmd.name, o) for cmd, ctx in _every_command() if not cmd.hidden
               for p in cmd.get_params(ctx) if p.param_type_name == "option"
               for o in [*p.opts, *p.secondary_opts] if o.startswith("--") and o not in typer_own}
    assert len(options) > 150
    missing = sorted((c, o) for c, o in options if not re.search(rf"{re.escape(o)}(?![\w-])", docs))
    assert not missing, missing
