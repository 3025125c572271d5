"""Grammars that hold a gpt-oss answer in its own format (OpenAI's harmony: core/harmony.py).

A grammar that held a gpt-oss answer from its first token to JSON (a response format, a
forced call in the fallback format) left the model no analysis and no message header: the
answer began with ``{`` where the model writes ``<|channel|>``. As llama.cpp's gpt-oss grammar
does, these hold the messages instead:

- ``answer_grammar``: any number of analysis (or recipient-less commentary) messages, their
  bodies free, then the message the request asks for: a call (``calls``) or the final
  message with a body in the requested format (``answer``), or either. The generation prompt
  ends with ``<|start|>assistant``, so the answer begins with a channel (or ``to=``).
- ``call_grammar``: one call message from its header's recipient or channel on, for the
  lazy grammar under ``tool_choice: "auto"``, which takes hold at ``CALL_TRIGGERS``.

A call's header names its recipient in the role's part (`` to=functions.NAME<|channel|>
commentary``) or after the channel (``<|channel|>commentary to=functions.NAME``), may say
its type (`` <|constrain|>json``), and its body is the arguments, held to the function's
schema; the answer ends there (the model's ``<|call|>`` ends generation). The grammar sees
each token's text with control tokens written (``<|end|>``), as llama.cpp's grammar reads it.
An analysis body is free text without ``<|`` (a marker would begin there): what the grammar
checks of it costs one token's look, since a sampled token is drawn first and checked.
"""

from __future__ import annotations

from justllm.core.harmony import CHANNEL, END, MESSAGE, START
from justllm.server.tools.grammar import prefixed_rules

_RULE = "justllm-harmony"
# Where the lazy grammar takes hold: a recipient of the functions' namespace, in the role's
# part of a header (the answer's first, or one after ``<|start|>assistant``) or after a
# channel; the grammar then holds the call from the group on.
CALL_TRIGGERS = (
    r"^\s*(to=functions\.)",
    r"^\s*(<\|channel\|>[a-z]+\s*to=functions\.)",
    r"<\|start\|>assistant\s*(to=functions\.)",
    r"<\|start\|>assistant\s*(<\|channel\|>[a-z]+\s*to=functions\.)",
)


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _shared_rules() -> list[str]:
    # A type word (`` json``, ``<|constrain|>json``) stands apart from what precedes it, so a
    # function's name cannot run on into it (``get`` + ``_weather`` read as get_weather).
    constrain = _literal("<|constrain|>")
    return [f'{_RULE}-ws ::= [ \\t\\n]*',
            f"{_RULE}-type ::= ([ \\t\\n]+ {constrain}? | {_RULE}-ws {constrain}) "
            "[A-Za-z0-9_-]+"]


def call_grammar(functions: list[tuple[str, str]]) -> str:
    """A call of one of ``functions`` ((name, GBNF of its parameters schema, rule ``root``)
    pairs; names are letters, digits, ``_`` and ``-``), from the recipient or the channel of
    its header on; rule ``root``."""
    alternatives, rules = [], []
    channel = f"{_literal(CHANNEL)} (\"commentary\" | \"analysis\")"
    for i, (name, gbnf) in enumerate(functions):
        prefix = f"{_RULE}-{i}-"
        rules.append(prefixed_rules(gbnf, prefix))
        to = _literal(f"to=functions.{name}")
        alternatives.append(
            f"({to} {_RULE}-ws {channel} {_RULE}-type? | {channel} {_RULE}-ws {to} "
            f"{_RULE}-type?) {_literal(MESSAGE)} {prefix}root")
    return "\n".join([f"root ::= {' | '.join(alternatives)}", *_shared_rules(), *rules])


def answer_grammar(calls: str | None, answer: str | None) -> str:
    """A whole answer: analysis or preamble messages, then a call (``calls``:
    :func:`call_grammar`'s) or the final message with its body held by ``answer`` (any
    grammar, rule ``root``), one of the two when both are given."""
    targets, rules = [], []
    if calls is not None:
        targets.append(f"{_RULE}-call-root")
        rules.append(prefixed_rules(calls, f"{_RULE}-call-"))
    if answer is not None:
        targets.append(f"{_literal(CHANNEL + 'final')} {_RULE}-type? {_literal(MESSAGE)} "
                       f"{_RULE}-answer-root")
        rules.append(prefixed_rules(answer, f"{_RULE}-answer-"))
    assert targets
    free = (f"{_literal(CHANNEL)} (\"analysis\" | \"commentary\") {_literal(MESSAGE)} "
            f"{_RULE}-body {_literal(END + START + 'assistant')}")
    return "\n".join([
        f"root ::= ({free})* {_RULE}-ws ({' | '.join(targets)})",
        # (no "<|" inside, where a marker would begin; a "<" may end it, before <|end|>)
        f'{_RULE}-body ::= ([^<] | "<"+ [^<|])* "<"*',
        *_shared_rules(), *rules])
