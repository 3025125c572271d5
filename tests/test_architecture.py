"""The layer contracts, lint and types run with the suite, so CI fails when one breaks.

Contracts (pyproject.toml, import-linter): cli > server|chat|bench|tui > engine, models > config >
spec > core > kv > errors, and only ``engine/backend.py`` imports ``llama_cpp``; see
docs/architecture.md.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_layer_contracts_hold():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    r = run(str(lint_imports), "--no-cache")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_ruff_is_clean():
    r = run(sys.executable, "-m", "ruff", "check", "justllm", "tests", "benchmarks", "plugins")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


# The real plugins' packages too (a type error in justllm-otel went unseen).
PLUGIN_PACKAGES = ("plugins/justllm-otel/justllm_otel",
                   "plugins/justllm-request-log/justllm_request_log",
                   "plugins/justllm-ollama/justllm_ollama.py")


def test_mypy_is_clean_on_every_layer():
    r = run(sys.executable, "-m", "mypy", "--no-incremental", "justllm", *PLUGIN_PACKAGES)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_every_module_is_named_in_the_module_map():
    """docs/architecture.md's layers name the modules of each folder; modules added since were
    missing from it (kv/host_cache.py, engine/vram.py, models/lease.py and 31 more)."""
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p for p in (ROOT / "justllm").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) > 150
    unnamed = [str(p.relative_to(ROOT)) for p in modules
               if not re.search(rf"(?<!\w){re.escape(p.stem)}(?!\w)", doc)]
    assert not unnamed, f"name these in docs/architecture.md: {unnamed}"
