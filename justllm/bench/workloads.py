"""Benchmark prompts: random text, a shared system prefix, or a ShareGPT-style file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

_WORDS = ("time person year way day thing man world life hand part child eye woman place work "
          "week case point number group problem fact river garden engine signal window paper "
          "market light music story winter orange silver planet ocean forest bridge").split()


# Every prompt is built in memory before the run (so that making them is not timed): a prompt
# longer than any model's context (a word is about a token) is refused, and so are more words
# in all than a few hundred MB of text.
MAX_PROMPT_WORDS = 1 << 20
MAX_TOTAL_WORDS = 1 << 26
MAX_REQUESTS = 100_000  # a task each, made at the start of a run


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def random_prompts(n: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """``input_len`` random words (about one token each for this vocabulary) per prompt."""
    rng = random.Random(seed)
    return [BenchRequest(f"{i}: {_words(rng, input_len)}", output_len) for i in range(n)]


def shared_prefix_prompts(n: int, prefix_len: int, input_len: int, output_len: int,
                          seed: int) -> list[BenchRequest]:
    """One system prefix of ``prefix_len`` words shared by all, then a distinct question."""
    rng = random.Random(seed)
    prefix = "System: " + _words(rng, prefix_len) + "\n"
    return [BenchRequest(f"{prefix}Question {i}: {_words(rng, input_len)}\nAnswer:", output_len)
            for i in range(n)]


def sharegpt_prompts(path: Path, n: int, output_len: int | None, seed: int) -> list[BenchRequest]:
    """First human turn of each conversation; output length from the reply (in words) unless
    ``output_len`` is given. The file is a JSON list of {"conversations": [{"from", "value"}]}."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read ShareGPT file {path}: {e}") from None
    pairs = []
    for item in data if isinstance(data, list) else []:
        turns = item.get("conversations") if isinstance(item, dict) else None
        exchange = _first_exchange(turns) if isinstance(turns, list) else None
        if exchange is not None and exchange[0].strip():
            human, reply = exchange
            pairs.append((human, max(1, min(len(reply.split()), 1024))))
    if not pairs:
        raise ValueError(f"{path} has no usable conversations")
    random.Random(seed).shuffle(pairs)
    return [BenchRequest(p, output_len or out) for p, out in (pairs * (n // len(pairs) + 1))[:n]]


_ASKER = ("human", "user")


def _first_exchange(turns: list) -> tuple[str, str] | None:
    """The first human turn and the turn after it (a system turn before it, which was taken
    as the prompt, is skipped); turns without ``from`` at all: the first two, as vLLM's
    benchmark takes them."""
    turns = [t for t in turns if isinstance(t, dict)]
    if not any("from" in t for t in turns):
        pair = turns[:2]
    else:
        first = next((i for i, t in enumerate(turns)
                      if str(t.get("from", "")).lower() in _ASKER), None)
        pair = turns[first:first + 2] if first is not None else []
    if len(pair) < 2:
        return None
    return str(pair[0].get("value", "")), str(pair[1].get("value", ""))
