"""A harmony answer (gpt-oss: core/harmony.py) -> thinking, content and tool calls.

A message addressed to ``functions.NAME`` is a call of NAME, its body the arguments; checked
as every format's calls are (an offered function, arguments a JSON object), and one that
fails the check is content, never an error. Without tools on offer, addressed messages are
dropped, as llama.cpp drops them (gpt-oss may address its built-in browser or python tools,
which nothing here runs). An answer not in the format (a grammar held it to a call's JSON, or
the model ignored the format) is read as the ``generic`` format's text.

``keep_thinking`` (``reasoning_format: none``): the thinking stays in the text, in its channel's
markers, as llama-server writes it (``<|channel|>analysis<|message|>...<|end|>`` before the
answer).
"""

from __future__ import annotations

from justllm.core.harmony import HarmonyReader
from justllm.server.tools.parse import Malformed, ParsedCall, checked_call
from justllm.server.tools.stream import CallSplitter

_FUNCTIONS = "functions."


class HarmonyText:
    """Feed an answer's pieces, get (thinking, content) to show; ``finish`` gives the rest and
    the calls. ``calls``: whether tools are on offer (``names`` the offered functions)."""

    def __init__(self, *, calls: bool, names: frozenset[str] | None = None,
                 parallel: bool = True, keep_thinking: bool = False) -> None:
        self._reader = HarmonyReader(keep_thinking)
        self._names, self._parallel = names, parallel
        # (None: no tools on offer, so no calls are read)
        self._plain = CallSplitter("generic", names, parallel) if calls else None

    def feed(self, piece: str) -> tuple[str, str]:
        thought, content = self._reader.feed(piece)
        if self._reader.reading.plain and self._plain is not None:
            content = self._plain.feed(content)
        return thought, content

    def finish(self) -> tuple[str, str, tuple[ParsedCall, ...]]:
        thought, content = self._reader.finish()
        reading = self._reader.reading
        if reading.plain and self._plain is not None:
            shown = self._plain.feed(content)
            rest, answer = self._plain.finish()
            return thought, shown + rest, answer.calls
        calls: list[ParsedCall] = []
        if self._plain is not None:
            for call in reading.calls:
                try:
                    if not call.recipient.startswith(_FUNCTIONS):
                        raise Malformed(f"{call.recipient} is not a function")
                    calls.append(checked_call({"name": call.recipient[len(_FUNCTIONS):],
                                               "arguments": call.body}, self._names))
                except Malformed:  # its text is content
                    content += ("\n\n" if reading.content or content else "") + call.body
        return thought, content, tuple(calls[:1] if not self._parallel else calls)
