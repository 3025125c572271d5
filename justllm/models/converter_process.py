"""The process llama.cpp's converter runs in: ``python -m justllm.models.converter_process
PARENT_PID OUTFILE SCRIPT ARGS...``.

It runs the converter script as ``__main__`` (its folder first on ``sys.path``, as when it is
run by hand), so a converter crash, an out-of-memory kill or torch's threads never touch the
justllm process. A watchdog thread ends it when its parent is gone (a parent killed hard cannot
stop it), removing the half-written OUTFILE first.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
from pathlib import Path


def _watch(parent: int, outfile: Path) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    try:
        outfile.unlink(missing_ok=True)
    finally:
        os._exit(1)


def main(argv: list[str]) -> None:
    parent, outfile, script = int(argv[0]), Path(argv[1]), Path(argv[2])
    threading.Thread(target=_watch, args=(parent, outfile), name="parent-watch",
                     daemon=True).start()
    sys.argv = [str(script), *argv[3:]]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
