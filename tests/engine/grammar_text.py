"""A text fed to one of llama.cpp's grammars a character at a time, as the model would write
it (what the grammar tests check)."""

from __future__ import annotations


def takes(backend, gbnf: str, text: str) -> bool:
    """Whether the grammar takes ``text`` whole, then the end of generation."""
    end = int(backend.eog_ids()[0])
    matcher = backend.grammar(gbnf)
    try:
        for ch in text:
            for t in backend.tokenize(ch, add_special=False, parse_special=False):
                if not matcher.allows(t):
                    return False
                matcher.accept(t)
        return matcher.allows(end)
    finally:
        matcher.close()
