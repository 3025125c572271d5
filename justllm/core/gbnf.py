"""Reading a GBNF grammar's text as llama.cpp does, for the checks and rewrites made before it
parses one (limits on a client's grammar, the JSON grammars' trailing space, the tool grammars'
renames): where string literals, character classes and comments are."""

from __future__ import annotations

import re

# String literals and character classes (with their escapes).
GBNF_STRING = r'"(?:\\.|[^"\\])*"'
GBNF_CLASS = r"\[(?:\\.|[^\]\\])*\]"
GBNF_LITERALS = re.compile(f"{GBNF_STRING}|{GBNF_CLASS}")
# A comment runs to the end of its line, "\r" or "\n" (llama.cpp's parse_space).
GBNF_COMMENT = r"#[^\r\n]*"
# What is not structure: literals, classes and comments (a quote or bracket in a comment
# read as one opening swallowed the structure after it).
GBNF_TEXT = re.compile(f"{GBNF_LITERALS.pattern}|{GBNF_COMMENT}")


_TOKEN = re.compile(f"(?P<lit>{GBNF_STRING})|(?P<cls>{GBNF_CLASS})|(?P<com>{GBNF_COMMENT})"
                    r"|(?P<def>::=)|(?P<name>[A-Za-z0-9_-]+)|(?P<rep>\{[^}]*\})"
                    r"|(?P<op>[()|?*+.])|(?P<ws>\s+)")

# A parsed alternative list: each alternative a list of (element, nullable-by-its-postfix);
# an element is a rule name (str), a group (list: alternatives again) or True/False (a
# terminal that matches nothing / something).
_Alts = list


def _rules(gbnf: str) -> dict[str, _Alts] | None:
    """``gbnf``'s rules, parsed far enough to see what each may begin with; None where the
    text is not what this reading expects (llama.cpp's parser then says what is wrong)."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(gbnf):
        m = _TOKEN.match(gbnf, pos)
        if m is None:
            return None
        pos = m.end()
        kind = m.lastgroup or ""
        if kind not in ("ws", "com"):
            tokens.append((kind, m.group()))
    starts = [i for i in range(len(tokens) - 1)
              if tokens[i][0] == "name" and tokens[i + 1][0] == "def"]
    out: dict[str, _Alts] = {}
    for n, i in enumerate(starts):
        body = tokens[i + 2:starts[n + 1] if n + 1 < len(starts) else len(tokens)]
        alts, end = _alternatives(body, 0)
        if alts is None or end != len(body):
            return None
        out[tokens[i][1]] = alts
    return out


def _alternatives(tokens: list[tuple[str, str]], i: int) -> tuple[_Alts | None, int]:
    alts: _Alts = [[]]
    while i < len(tokens):
        kind, text = tokens[i]
        if text == ")":
            break
        i += 1
        if text == "|":
            alts.append([])
            continue
        if text == "(":
            group, i = _alternatives(tokens, i)
            if group is None or i >= len(tokens) or tokens[i][1] != ")":
                return None, i
            i += 1
            element: object = group
        elif kind == "name":
            element = text
        elif kind == "lit":
            element = text == '""'  # (an empty literal matches nothing)
        elif kind == "cls" or text == ".":
            element = False
        else:
            return None, i
        optional = False
        if i < len(tokens) and (tokens[i][1] in ("?", "*", "+") or tokens[i][0] == "rep"):
            mark = tokens[i][1]
            optional = mark in ("?", "*") or bool(re.fullmatch(r"\{\s*0\s*(,.*)?\}", mark))
            i += 1
        alts[-1].append((element, optional))
    return alts, i


def left_recursion(gbnf: str) -> str | None:
    """A rule of ``gbnf`` that may begin with itself (through other rules and whatever may
    match nothing before them), which llama.cpp refuses to parse ("left recursion"); None
    where there is none, or where the text is not read here."""
    rules = _rules(gbnf)
    if rules is None:
        return None
    empty: set[str] = set()

    def nullable(alts: _Alts) -> bool:
        return any(all(opt or _matches_nothing(e) for e, opt in seq) for seq in alts)

    def _matches_nothing(e: object) -> bool:
        if isinstance(e, str):
            return e in empty
        return nullable(e) if isinstance(e, list) else bool(e)

    changed = True
    while changed:
        changed = False
        for name, alts in rules.items():
            if name not in empty and nullable(alts):
                empty.add(name)
                changed = True

    def first(alts: _Alts) -> set[str]:
        out: set[str] = set()
        for seq in alts:
            for e, opt in seq:
                if isinstance(e, str):
                    out.add(e)
                elif isinstance(e, list):
                    out |= first(e)
                if not (opt or _matches_nothing(e)):
                    break
        return out

    begins = {name: first(alts) & rules.keys() for name, alts in rules.items()}
    for start in rules:  # (a walk per rule: the grammars read here are small)
        seen: set[str] = set()
        todo = list(begins[start])
        while todo:
            name = todo.pop()
            if name == start:
                return start
            if name not in seen:
                seen.add(name)
                todo += begins[name]
    return None
