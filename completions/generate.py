"""Write completions/justllm.{bash,zsh,fish}: the scripts the CLI generates
(``_JUSTLLM_COMPLETE=source_SHELL justllm``), with one change.

zsh and fish show each candidate's help, which Typer renders with rich at the terminal's
width: piped, as the scripts call justllm, 80 columns (or $COLUMNS). A help text longer than
that came out on several lines, and fish took each further line for a candidate of its own
(``in its own process.`` for ``justllm ``); zsh's descriptions broke across lines. The scripts
therefore call justllm with TERMINAL_WIDTH (the width Typer's completion reads first) wide
enough for any help text on one line. (bash shows no help.)

    python completions/generate.py            # rewrite the three files
    python completions/generate.py --check    # exit 1 if one is stale (CI: tests/cli)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHELLS = ("bash", "zsh", "fish")
WIDE = "TERMINAL_WIDTH=100000"


def script(shell: str) -> str:
    """The completion script for ``shell`` as it should be checked in."""
    env = {**os.environ, "_JUSTLLM_COMPLETE": f"source_{shell}"}
    out = subprocess.run([sys.executable, "-c", "import sys; sys.argv[0] = 'justllm'; "
                          "from justllm.cli import app; app(prog_name='justllm')"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    text = out.stdout.strip() + "\n"
    if shell == "bash":
        return text
    # The call that lists the candidates with their help: `$(env ...` (zsh), `(env ...` (fish).
    if text.count("(env ") != 1:
        raise RuntimeError(f"Typer's {shell} script changed: no single '(env ' call to widen")
    return text.replace("(env ", f"(env {WIDE} ")


def main(argv: list[str]) -> int:
    stale = []
    for shell in SHELLS:
        path = HERE / f"justllm.{shell}"
        want = script(shell)
        if "--check" in argv:
            if not path.is_file() or path.read_text() != want:
                stale.append(path.name)
        else:
            path.write_text(want)
    if stale:
        print(f"stale: {', '.join(stale)}: run python completions/generate.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
