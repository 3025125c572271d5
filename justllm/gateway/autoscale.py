"""When a model's local replicas should grow or shrink: a pure function of the load the gateway
sees, the time, and what it decided before (no clock, no processes).

Ray Serve's rule, which users of it know: the replicas wanted are the requests in flight
(running + waiting, summed over the replicas) over ``target_ongoing``, rounded up and kept
between ``min_replicas`` (at least 1 while the model is loaded: to zero is the ttl's business)
and ``max_replicas``. A change is made only when the wish has pointed the same way for the
whole delay (``upscale_delay`` up, ``downscale_delay`` down), so a burst shorter than the delay
does not start a process and a pause does not stop one. Up, it goes straight to the count
wanted then; down, to the most replicas wanted at any time during the delay (Ray Serve reads
the load averaged over 30 s: a dip at the moment of the decision took away replicas the load
had needed all along, which the next upscale delay started again). A replica stopped leaves
the rotation at once and drains its requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


@dataclass(frozen=True)
class AutoscaleConfig:
    """A model's ``min-replicas`` / ``max-replicas`` and its scaling options (YAML names
    ``target-ongoing``, ``upscale-delay``, ``downscale-delay``); Ray Serve's defaults."""

    min_replicas: int
    max_replicas: int
    target_ongoing: float = 2.0
    upscale_delay: float = 30.0
    downscale_delay: float = 600.0

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ValueError("min-replicas must be >= 0 and max-replicas >= max(1, "
                             "min-replicas)")
        # (so written that a NaN or an infinity breaks them: ceil(load / nan) raised inside
        # the supervisor's watch loop, which died without a word)
        if not (0 < self.target_ongoing < math.inf and 0 <= self.upscale_delay < math.inf
                and 0 <= self.downscale_delay < math.inf):
            raise ValueError("target-ongoing must be > 0 and the delays >= 0 (finite numbers)")


@dataclass(frozen=True)
class Pending:
    """The wish the last calls agreed on: ``target`` replicas, pointing the same way since
    ``since`` (seconds of the caller's clock)."""

    target: int
    since: float


@dataclass(frozen=True)
class Scale:
    """A decision: go to ``target`` replicas, and why (logged and exported)."""

    target: int
    direction: str  # "up" or "down"
    reason: str


def wanted(config: AutoscaleConfig, load: float) -> int:
    """Replicas wanted for ``load`` requests in flight, within the bounds (at least 1)."""
    want = math.ceil(load / config.target_ongoing - 1e-9) if load > 0 else 0
    return max(max(1, config.min_replicas), min(config.max_replicas, want))


def decide(config: AutoscaleConfig, current: int, load: float, now: float,
           pending: Pending | None) -> tuple[Scale | None, Pending | None]:
    """What to do with ``current`` replicas carrying ``load`` requests (running + waiting, all
    replicas): a :class:`Scale` once the wish has lasted its delay, and the wish to remember
    for the next call (None when the count is right)."""
    target = wanted(config, load)
    if target == current:
        return None, None
    up = target > current
    if pending is None or (pending.target > current) != up or pending.target == current:
        # a new wish, or one that changed direction (or that a replica lost met meanwhile)
        pending = Pending(target, now)
    else:  # same direction: up, the size follows the load; down, the most it wanted holds
        pending = Pending(target if up else max(target, pending.target), pending.since)
    target = pending.target
    delay = config.upscale_delay if up else config.downscale_delay
    if now - pending.since < delay:
        return None, pending
    mean = load / current if current else load
    side = "above" if up else "below"
    floor = max(1, config.min_replicas)
    if up and target == floor and mean <= config.target_ongoing:  # (a replica lost, say)
        why = f"{current} serving, fewer than min-replicas {floor}"
    else:
        why = f"{mean:.1f} requests per replica, {side} the target of {config.target_ongoing:g}"
    return Scale(target, "up" if up else "down", f"{why}, for {delay:g} s"), None


class Retirable(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def routable(self) -> bool: ...
    @property
    def load_total(self) -> int: ...


R = TypeVar("R", bound=Retirable)


def to_retire(replicas: Sequence[R], target: int) -> list[R]:
    """Which of a pool's ``replicas`` a scale down to ``target`` stops: those out of the
    rotation first (starting, restarting, unhealthy: Ray Serve stops starting replicas first,
    and keeping one that restarts while the ready one went left none to serve), then the
    least busy, the newest of equals (the first replicas are kept)."""
    order = sorted(replicas, key=lambda r: (r.routable, r.load_total, -int(r.id)))
    return order[:max(0, len(replicas) - target)]
