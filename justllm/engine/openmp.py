"""How long llama.cpp's OpenMP threads keep a core busy after a decode.

A CPU build of llama.cpp computes a graph with OpenMP (libgomp on Linux), whose threads, once
the graph is done, spin for ``GOMP_SPINCOUNT`` rounds before they sleep: 300,000 by default,
which on a recent Xeon (a ``pause`` of ~100 cycles) keeps every core but the engine thread's
busy for several milliseconds after each decode, the whole time the engine chooses the step's
tokens. So on a CPU build using every core the engine chose them on its own thread alone
(engine/row_sampling.py). Inside a graph ggml waits at OpenMP barriers between operations, so
the threads must spin there (``OMP_WAIT_POLICY=passive`` sleeps at every barrier: 8 sequences
decoded at 118 tok/s against 155 on the project's 2-core Xeon); 3,000 rounds cover those
waits (the same 47 and 157 tok/s at 1 and 8 sequences as the default, 2026-12-04) and free the
cores a fraction of a millisecond after the decode, so the step's rows are prepared on every
core there too.

libgomp reads its settings once, as it loads with llama.cpp, so :func:`short_spin` sets the
count just for that moment (the environment children inherit is left as it was) unless the
user chose a policy of their own, and says whether the threads will sleep soon after a
decode.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

SPIN_COUNT = 3000


@contextlib.contextmanager
def short_spin(maps: Path = Path("/proc/self/maps")) -> Iterator[bool]:
    """Around llama.cpp's first import: yields whether its OpenMP threads will sleep soon
    after each decode. False when libgomp is already in the process (it read its settings
    then; it is loaded once) unless the environment already asked for a short wait, or when
    the user set ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` to something else (theirs is
    kept)."""
    env = os.environ
    policy = env.get("OMP_WAIT_POLICY", "").strip().lower()
    spin = env.get("GOMP_SPINCOUNT")
    if spin is not None or policy:
        yield policy == "passive" or (spin is not None and _count(spin) <= SPIN_COUNT)
        return
    if _libgomp_loaded(maps):
        yield False
        return
    env["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    try:
        yield True
    finally:
        env.pop("GOMP_SPINCOUNT", None)


def _count(value: str) -> float:
    """libgomp's reading of ``GOMP_SPINCOUNT``: a count, perhaps with a k/M/G/T suffix, or
    ``infinite``/``infinity``; anything else counts as long here."""
    value = value.strip().lower()
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}.get(value[-1:], 1.0)
    number = value[:-1] if scale != 1.0 else value
    try:
        return float(int(number)) * scale
    except ValueError:
        return float("inf")


def _libgomp_loaded(maps: Path) -> bool:
    try:
        return "libgomp" in maps.read_text()
    except OSError:  # no /proc (not Linux): no libgomp either
        return False
