"""The checked-in shell completions are what the CLI generates now."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completions_are_current(shell):
    env = {**os.environ, "_JUSTLLM_COMPLETE": f"source_{shell}"}
    out = subprocess.run([sys.executable, "-c", "import sys; sys.argv[0] = 'justllm'; "
                          "from justllm.cli import app; app(prog_name='justllm')"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (ROOT / "completions" / f"justllm.{shell}").read_text().strip(), (
        f"completions/justllm.{shell} is stale: regenerate it (see completions/README.md)")
