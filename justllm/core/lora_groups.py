"""Which LoRA adapter set the next step serves.

llama.cpp applies adapters to a whole context, so a step's batch can only hold requests of one
adapter set (the base model is the empty set). Requests of the same set batch together; between
sets the policy is fair and cheap:

- the set served last goes on while it has work, for at most ``max_steps`` consecutive steps
  (each change of set costs llama.cpp a new compute graph, so changing every step wastes time);
- then, or when it has no work left, the set whose work has waited longest goes next: a set
  waits from its last service or, if later, from when its oldest request was queued.

So with ``k`` sets that have work, a set waits at most ``(k - 1) * max_steps`` steps: none
starves, whatever arrives meanwhile. Pure: the scheduler passes the step count and the sets.
"""

from __future__ import annotations

from collections.abc import Iterable

from justllm.core.request import LoraKey


class LoraGroups:
    """The choice of the adapter set per step, and the little it remembers: the set served
    last, its run of consecutive steps, and when each set with work was last served."""

    def __init__(self, max_steps: int) -> None:
        if max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        self.max_steps = max_steps
        self.current: LoraKey | None = None
        self.streak = 0
        self._served: dict[LoraKey, int] = {}

    def order(self, oldest: dict[LoraKey, int]) -> list[LoraKey]:
        """The sets with work, most deserving first. ``oldest`` maps each set with work to the
        step its oldest request was queued; the scheduler serves the first set that can
        make progress (a set whose requests wait for KV or a sequence id yields its turn)."""
        for key in [k for k in self._served if k not in oldest]:
            del self._served[key]  # no work left: it waits afresh when work comes

        def waited_since(key: LoraKey) -> tuple[int, int, LoraKey]:
            return max(self._served.get(key, -1), oldest[key]), oldest[key], key

        others = sorted((k for k in oldest if k != self.current), key=waited_since)
        cur = self.current
        if cur is None or cur not in oldest:
            return others
        if self.streak < self.max_steps or not others:
            return [cur] + others
        return others + [cur]

    def served(self, key: LoraKey, step: int) -> None:
        """A step served ``key`` (at the scheduler's step ``step``)."""
        if key == self.current:
            self.streak += 1
        else:
            self.current, self.streak = key, 1
        self._served[key] = step


def oldest_by_set(requests: Iterable[tuple[LoraKey, int]]) -> dict[LoraKey, int]:
    """Each adapter set -> the smallest queued step among its requests."""
    out: dict[LoraKey, int] = {}
    for key, step in requests:
        if key not in out or step < out[key]:
            out[key] = step
    return out
