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
from justllm.server.tools.json_stream import JsonStream
from justllm.server.tools.parse import Malformed, ParsedCall, checked_call
from justllm.server.tools.stream import (
    CallDelta,
    CallOpened,
    CallPiece,
    CallSplitter,
    rest_of_calls,
)

_FUNCTIONS = "functions."


class HarmonyText:
    """Feed an answer's pieces, get (thinking, content) to show; ``finish`` gives the rest and
    the calls. ``calls``: whether tools are on offer (``names`` the offered functions).

    A call a grammar holds (``held``: tools/harmony_grammar.py's, from its header's recipient
    on) streams as it is written, as every family's held calls do (tools/stream.py): it opens
    at its recipient, its arguments follow as canonical JSON text (``json_stream.py``), and
    cut off (``max_tokens``) it stands as far as it came. Other calls come whole."""

    def __init__(self, *, calls: bool, names: frozenset[str] | None = None,
                 parallel: bool = True, keep_thinking: bool = False) -> None:
        self._reader = HarmonyReader(keep_thinking)
        self._names, self._parallel = names, parallel
        # (None: no tools on offer, so no calls are read)
        self._plain = CallSplitter("generic", names, parallel) if calls else None
        self._streams: list[tuple[str, list[str]]] = []  # (name, argument pieces) streamed
        self._args: JsonStream | None = None  # the streamed call's arguments, while open
        self._at = -1  # the reader's index of the call being streamed
        self._stopped = False  # a call went unstreamed: later ones come whole too
        self._deltas: list[CallDelta] = []

    def feed(self, piece: str, held: bool = False) -> tuple[str, str]:
        thought, content = self._reader.feed(piece)
        if self._reader.reading.plain and self._plain is not None:
            content = self._plain.feed(content, held)
        self._stream(held)
        return thought, content

    def deltas(self) -> list[CallDelta]:
        """The calls' news since the last time asked (``deltas`` of tools/stream.py)."""
        if self._plain is not None and self._reader.reading.plain:
            return self._plain.deltas()
        out, self._deltas = self._deltas, []
        return out

    def _stream(self, held: bool) -> None:
        for index, recipient, text in self._reader.take_addressed():
            if index != self._at:
                self._args = None
                name = recipient[len(_FUNCTIONS):]
                # (streamed calls are the reading's first ones, in order: finish pairs them
                # by position; a call before them with no body is no news, hence the index)
                if (self._stopped or self._plain is None or not held
                        or index != len(self._streams)
                        or not recipient.startswith(_FUNCTIONS)
                        or (self._names is not None and name not in self._names)
                        or (self._streams and not self._parallel)):
                    self._stopped = True
                    continue
                self._at, self._args = index, JsonStream()
                self._streams.append((name, []))
                self._deltas.append(CallOpened(len(self._streams) - 1, name))
            if self._args is None:
                continue
            piece = self._args.feed(text)
            if piece:
                self._streams[-1][1].append(piece)
                self._deltas.append(CallPiece(len(self._streams) - 1, piece))

    def finish(self) -> tuple[str, str, tuple[ParsedCall, ...], bool]:
        """The thinking and content not given yet, the answer's calls, and whether the
        answer was cut off inside a held call (which then stands as far as it came);
        ``deltas`` then gives what the stream still owes of the calls."""
        thought, content = self._reader.finish()
        self._stream(held=False)  # (what finishing read of a streamed call's body)
        reading = self._reader.reading
        if reading.plain and self._plain is not None:
            shown = self._plain.feed(content)
            rest, answer = self._plain.finish()
            return thought, shown + rest, answer.calls, answer.cut
        calls: list[ParsedCall] = []
        cut = False
        # (no tools on offer: addressed messages are dropped)
        for k, call in enumerate(reading.calls if self._plain is not None else ()):
            try:
                if not call.recipient.startswith(_FUNCTIONS):
                    raise Malformed(f"{call.recipient} is not a function")
                calls.append(checked_call({"name": call.recipient[len(_FUNCTIONS):],
                                           "arguments": call.body}, self._names))
            except Malformed:
                if k < len(self._streams):  # held by a grammar, streamed: cut off
                    name, pieces = self._streams[k]
                    calls.append(ParsedCall(name, "".join(pieces)))
                    cut = True
                    break
                content += ("\n\n" if reading.content or content else "") + call.body
        if not self._parallel:
            calls = calls[:1]
        self._deltas += rest_of_calls([(n, "".join(p)) for n, p in self._streams],
                                      tuple(calls))
        return thought, content, tuple(calls), cut
