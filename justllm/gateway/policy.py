"""The gateway's decisions, as pure functions over plain values: which idle model to unload,
when an idle model expires, how long to wait before restarting a runner, and what Ollama's
``keep_alive`` means."""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_FAILURES = 3  # consecutive failed starts before a model is reported failed


@dataclass(frozen=True)
class Loaded:
    """What the policies need to know of one loaded model."""

    name: str
    active: int  # requests in flight
    last_used: float  # when its last request ended (or it loaded)
    ttl: float  # idle seconds before it unloads; < 0 never


def expired(models: list[Loaded], now: float) -> list[str]:
    """Idle models whose time to live has passed."""
    return [m.name for m in models
            if m.active == 0 and m.ttl >= 0 and now - m.last_used >= m.ttl]


def to_unload_for(models: list[Loaded], max_loaded: int, loading: int = 1) -> list[str] | None:
    """The least recently used idle models to unload so ``loading`` more fit under
    ``max_loaded`` (0: no limit); ``None`` when too few are idle (the caller waits)."""
    if max_loaded == 0:
        return []
    excess = len(models) + loading - max_loaded
    if excess <= 0:
        return []
    idle = sorted((m for m in models if m.active == 0), key=lambda m: m.last_used)
    if len(idle) < excess:
        return None
    return [m.name for m in idle[:excess]]


def restart_delay(failures: int) -> float | None:
    """Seconds before starting a runner again after ``failures`` consecutive failures
    (exponential: 0.5, 1, 2 s); None once there have been MAX_FAILURES."""
    if failures >= MAX_FAILURES:
        return None
    return 0.5 * 2 ** max(0, failures - 1) if failures else 0.0


_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def keep_alive_seconds(value: object) -> float:
    """Ollama's ``keep_alive``: seconds (a number) or a duration ("5m", "1h", "30s");
    0 unloads after the request, a negative value keeps the model loaded."""
    if isinstance(value, bool):
        raise ValueError("keep_alive must be a number of seconds or a duration such as '5m'")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and (m := _DURATION.match(value)):
        return float(m.group(1)) * _UNIT[m.group(2)]
    raise ValueError("keep_alive must be a number of seconds or a duration such as '5m'")
