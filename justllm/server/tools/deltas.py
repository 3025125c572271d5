"""A streamed answer's news of its calls: a call opened, a piece of its arguments."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallOpened:
    call_index: int
    name: str


@dataclass(frozen=True)
class CallPiece:
    call_index: int
    arguments: str  # a piece of the call's arguments (canonical JSON text)


CallDelta = CallOpened | CallPiece
