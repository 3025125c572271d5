"""OpenAI's harmony format (gpt-oss): an answer read as its messages, whole or as it streams.

A gpt-oss model answers in messages, each a header and a body. The generation prompt ends
with ``<|start|>assistant``, so the answer begins with the first message's header:

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>Rome.<|return|>

- ``analysis``: the thinking; ``final``: the answer; ``commentary`` without a recipient: a
  preamble the user may see (content, as llama.cpp reads it);
- a message with a recipient (`` to=functions.get_weather``, in the role's part of the header
  or after the channel) is a call: its body is the arguments (``<|constrain|>json`` may say
  their type), and it ends the answer with ``<|call|>``.

``<|return|>`` and ``<|call|>`` end generation; ``<|end|>`` is a control token that a
detokenizer without special tokens leaves out, so a body also ends where the next header
begins (``<|start|>``, or a ``<|channel|>`` a model writes without one). An answer that does
not begin with a header (a grammar held it to JSON, or the model ignored the format) is all
``plain`` text. A header with another role (the model going on with a user's turn) ends the
answer.

:class:`HarmonyReader` gives each body's text as soon as it cannot change (text that may still
be a marker is held back, and so are trailing blanks), so the pieces add up to the whole
reading; bodies of a kind are joined with a blank line, stripped of the blanks around them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from justllm.core.reasoning import partial_tail

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
# What ends a body: the end tokens, or the next header's first marker.
_BODY_ENDS = (END, "<|call|>", "<|return|>", START, CHANNEL)
_CONSUMED = (END, "<|call|>", "<|return|>")  # (a header's markers begin the next message)
# The analysis channel's bounds: where a harmony model's thinking is (as llama.cpp names them).
THINKING = (CHANNEL + "analysis" + MESSAGE, END)
# Where a thinking budget counts (core/thinking_budget.py reads tokens' text): the analysis
# body, which ends where the next message starts (the ``<|end|>`` before it is a control token
# that a token's text does not show).
BUDGET_TAGS = (THINKING[0], START)
_HEADS = (CHANNEL, START, "to=")  # what an answer in the format begins with
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_ROLE = re.compile(r"\s*([A-Za-z_]+)")


def budget_closing(message: str) -> str:
    """What a spent thinking budget forces: ``message``, the analysis's end, and the final
    channel's header (llama.cpp forces ``<|end|>`` and lets the model write the header)."""
    return f"{message}{END}{START}assistant{CHANNEL}final{MESSAGE}"


def is_harmony(template_source: str) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss's)."""
    return CHANNEL in template_source and MESSAGE in template_source


@dataclass(frozen=True)
class Addressed:
    """A message with a recipient (a call): ``functions.NAME``, and its body, stripped."""

    recipient: str
    body: str


@dataclass
class Reading:
    """What an answer said: the thinking, the content, the calls (in order), and whether it
    was plain text (not in the format)."""

    thinking: str = ""
    content: str = ""
    calls: list[Addressed] = field(default_factory=list)
    plain: bool = False


class HarmonyReader:
    """Feed an answer's text as it comes; each call gives the thinking and content that can be
    shown now, and :meth:`finish` what was held back (as ``ReasoningSplitter`` does); the
    calls are in ``reading`` once it has finished."""

    def __init__(self, keep_thinking: bool = False) -> None:
        """``keep_thinking``: the analysis stays in the content, in its channel's markers
        (``<|channel|>analysis<|message|>...<|end|>``), as llama-server writes it."""
        self._keep = keep_thinking
        self._buf = ""  # text not yet read
        self._state = "begin"  # begin | header | body | plain | done
        self._channel = ""
        self._recipient: str | None = None
        self._args: list[str] = []  # an addressed body so far
        self._fresh = True  # at a body's start: its leading blanks are dropped
        self._shown = False  # whether the body has shown text
        self._blanks = ""  # trailing blanks of the body, held until more text follows
        self.reading = Reading()
        # What was read of addressed bodies since ``take_addressed``: (the message's index
        # among the calls, its recipient, text)
        self._addressed: list[tuple[int, str, str]] = []

    def take_addressed(self) -> list[tuple[int, str, str]]:
        """The text read of addressed messages' bodies (calls) since the last time asked, as
        (the call's index in ``reading.calls``, its recipient, text): a call's arguments as
        they come (its body's leading blanks dropped)."""
        out, self._addressed = self._addressed, []
        return out

    def feed(self, piece: str) -> tuple[str, str]:
        """Append ``piece``; the thinking and the content to show now."""
        self._buf += piece
        out = {"thinking": "", "content": ""}
        self._run(out, final=False)
        return out["thinking"], out["content"]

    def finish(self) -> tuple[str, str]:
        """At the answer's end: the thinking and content not shown yet (``reading`` then
        holds the whole answer's, calls included)."""
        out = {"thinking": "", "content": ""}
        self._run(out, final=True)
        if self._state == "body":
            self._end_body(out)
        self._state, self._buf = "done", ""
        return out["thinking"], out["content"]

    def _run(self, out: dict[str, str], final: bool) -> None:
        while self._buf:
            if self._state == "begin":
                lead = self._buf.lstrip()
                if any(lead.startswith(h) for h in _HEADS):
                    self._buf, self._state = lead, "header"
                elif not final and any(h.startswith(lead) for h in _HEADS):
                    return  # blanks, or what may still become a header
                else:
                    self._state, self.reading.plain = "plain", True
            elif self._state == "plain":
                self._emit("content", self._take(len(self._buf)), out)
            elif self._state == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    return  # (a header cut off at the end is nothing)
                self._state = "body" if self._open(self._buf[:at]) else "done"
                self._buf = self._buf[at + len(MESSAGE):]
            elif self._state == "body":
                ends = [(i, m) for m in _BODY_ENDS if (i := self._buf.find(m)) >= 0]
                if not ends:
                    keep = 0 if final else partial_tail(self._buf, *_BODY_ENDS)
                    self._body_text(self._take(len(self._buf) - keep), out)
                    return
                at, marker = min(ends)
                self._body_text(self._take(at), out)
                self._end_body(out)
                if marker in _CONSUMED:
                    self._buf = self._buf[len(marker):]
                self._state = "header"
            else:  # done: what follows is not the assistant's
                self._buf = ""

    def _take(self, n: int) -> str:
        text, self._buf = self._buf[:n], self._buf[n:]
        return text

    def _open(self, header: str) -> bool:
        """Start the body a header announces; False when it is another role's."""
        header = header.replace(END, "").lstrip()
        if header.startswith(START):
            role = _ROLE.match(header[len(START):])
            if role is None or role.group(1) != "assistant":
                return False
        found = _RECIPIENT.search(header)
        self._recipient = found.group(1) if found else None
        name = _CHANNEL_NAME.search(header)
        self._channel = name.group(1) if name else ("commentary" if found else "final")
        return True

    def _body_text(self, text: str, out: dict[str, str]) -> None:
        if self._fresh:
            text = text.lstrip()
            if not text:
                return
            self._fresh = False
        if self._recipient is not None:  # a call's arguments
            self._args.append(text)
            self._addressed.append((len(self.reading.calls), self._recipient, text))
            return
        thinking = self._channel == "analysis"
        kind = "thinking" if thinking and not self._keep else "content"
        stripped = text.rstrip()
        if not stripped:
            self._blanks += text
            return
        lead = self._blanks
        if not self._shown:  # the body's first text: after a body of its kind, a blank line
            before = getattr(self.reading, kind)
            lead = ("" if not before or before.endswith(END) else "\n\n") + (
                THINKING[0] if thinking and self._keep else "")
        self._emit(kind, lead + stripped, out)  # (another body of a kind: a blank line first)
        self._shown, self._blanks = True, text[len(stripped):]

    def _end_body(self, out: dict[str, str]) -> None:
        if self._keep and self._shown and self._channel == "analysis":
            self._emit("content", END, out)
        if self._recipient is not None:
            self.reading.calls.append(Addressed(self._recipient, "".join(self._args).strip()))
        self._recipient, self._args, self._blanks = None, [], ""
        self._fresh, self._shown = True, False

    def _emit(self, kind: str, text: str, out: dict[str, str]) -> None:
        out[kind] += text
        setattr(self.reading, kind, getattr(self.reading, kind) + text)
