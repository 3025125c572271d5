"""``justllm models/ls/show/rm`` on a models directory holding the demo GGUF."""

import os

import pytest
from typer.testing import CliRunner

from justllm.cli import app

runner = CliRunner()


@pytest.fixture
def models_dir(tmp_path, model_path, monkeypatch):
    os.symlink(model_path, tmp_path / "tiny-gemma.gguf")
    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(tmp_path))
    return tmp_path


def test_models_lists_metadata(models_dir):
    for cmd in ("models", "ls"):
        r = runner.invoke(app, [cmd])
        assert r.exit_code == 0, r.output
        row = next(line for line in r.output.splitlines() if line.startswith("tiny-gemma"))
        assert row.split() == ["tiny-gemma", "253.1", "MB", "Q4_K_M", "gemma3", "32768"]


def test_show_and_names_resolve_for_run(models_dir):
    r = runner.invoke(app, ["show", "tiny-gemma"])
    assert r.exit_code == 0, r.output
    assert "general.architecture" in r.output and "Q4_K_M" in r.output
    r = runner.invoke(app, ["show", "tiny-gemma", "--template"])
    assert "no chat template" in r.output
    r = runner.invoke(app, ["run", "tiny-gemma", "--raw", "-p", "Hi", "-n", "2", "--pool-blocks", "32"])
    assert r.exit_code == 0 and "generation 2 tok" in r.output


def test_rm_and_errors(models_dir):
    r = runner.invoke(app, ["rm", "nope"])
    assert r.exit_code == 1 and r.output.startswith("error: no model named 'nope'")
    r = runner.invoke(app, ["rm", "tiny-gemma"])
    assert r.exit_code == 0 and not (models_dir / "tiny-gemma.gguf").exists()
    r = runner.invoke(app, ["models"])
    assert "no models in" in r.output
