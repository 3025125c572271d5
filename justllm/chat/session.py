"""The chat loop: input (with \"\"\" multi-line blocks), slash commands, streaming answers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator
from contextlib import closing
from typing import TextIO

from justllm.chat.backends import ContextFull, Thought
from justllm.core.sampling_params import SamplingParams
from justllm.errors import InvalidRequestError, JustLLMError

HELP = """commands (a line whose first non-blank is /):
  /set temperature 0.2   (also top_p, top_k, min_p, max_tokens, seed, repeat_penalty;
                         /set seed none: a new draw each answer again)
  /system [TEXT]         set the system message, or remove it (and clear the history)
  /clear                 forget the conversation
  /stats                 speed of the last answer
  /bye                   leave (Ctrl-D too)
  \"\"\"                    start and end a multi-line message (always a message, even
                         one that starts with /)
Ctrl-C stops the current answer."""


def check_options(options: dict) -> None:
    """InvalidRequestError naming the first sampling option out of its range (an answer has
    at least one token)."""
    if options.get("max_tokens", 1) < 1:
        raise InvalidRequestError(f"max_tokens must be >= 1 (got {options['max_tokens']})",
                                  param="max_tokens")
    SamplingParams(**options)


def _seed(value: str) -> int | None:
    """A seed, or ``none``: no seed (once set, it could not be taken back)."""
    return None if value.lower() == "none" else int(value)


_SETTABLE: dict[str, Callable[[str], object]] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int,
    "seed": _seed, "repeat_penalty": float}
# Each command as it is used: one given words it does not take answers with this.
_USAGE = {"/?": "/?", "/help": "/help", "/clear": "/clear", "/stats": "/stats", "/bye": "/bye",
          "/system": "/system [TEXT]", "/set": f"/set {'|'.join(_SETTABLE)} VALUE"}


class ChatSession:
    def __init__(self, backend, *, system: str | None, options: dict,
                 read: Callable[[str], str] = input, out: TextIO = sys.stdout) -> None:
        self.backend = backend
        self.system = system
        self.options = dict(options)
        self.history: list[dict] = []
        self.read = read
        self.out = out
        self._left_out = 0  # messages the answer being streamed was asked without

    def messages(self, skip: int = 0) -> list[dict]:
        """The system message and the conversation without its first ``skip`` messages."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history[skip:]

    def _say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _note(self, text: str) -> None:
        """A line about the chat itself, not the model's: dim on a terminal."""
        dim = getattr(self.out, "isatty", lambda: False)()
        self._say(f"\x1b[2m{text}\x1b[0m" if dim else text)

    def _read_message(self) -> tuple[str, bool] | None:
        """One message, and whether it came in a \"\"\" block (then it is never a command);
        None at end of input."""
        try:
            line = self.read(">>> ")
        except EOFError:  # Ctrl-D: the shell's prompt goes on a line of its own
            self._say()
            return None
        if not line.strip().startswith('"""'):
            return line, False
        lines = [line.strip()[3:]]
        while not lines[-1].rstrip().endswith('"""') or len(lines) == 1 and lines[0] == "":
            try:
                lines.append(self.read("... "))
            except EOFError:
                break
        lines[-1] = lines[-1].rstrip().removesuffix('"""')
        return "\n".join(lines).strip("\n"), True

    def run(self) -> None:
        self._say('type a message, /? for help, /bye to leave')
        while True:
            try:
                read = self._read_message()
            except KeyboardInterrupt:
                self._say("\n(use Ctrl-D or /bye to leave)")
                continue
            if read is None:
                return
            text, block = read
            if not text.strip():
                continue
            # One rule for every command: a line whose first non-blank is "/" ("  /bye" left
            # and "  /clear" was a message); a block is always a message.
            if not block and text.lstrip().startswith("/"):
                if self._command(text.strip()):
                    return
            else:
                self._answer(text)

    def _command(self, text: str) -> bool:
        """Run one slash command; True for /bye. Words are split on any blanks (a tab too);
        a command given words it does not take prints its usage and does nothing."""
        name, *rest = text.split(maxsplit=1)
        arg = rest[0] if rest else ""
        if name not in _USAGE:
            self._say(f"unknown command {name} (/? for help; a \"\"\" block sends text that "
                      "starts with / as a message)")
            return False
        if name not in ("/system", "/set") and arg:
            self._say(f"usage: {_USAGE[name]} (it takes no words after it)")
            return False
        if name == "/bye":
            return True
        if name in ("/?", "/help"):
            self._say(HELP)
        elif name == "/clear":
            self.history.clear()
            self._say("(conversation cleared)")
        elif name == "/system":
            self.system = arg.strip() or None
            self.history.clear()
            self._say("(system message set)" if self.system else "(system message removed)")
        elif name == "/set":
            self._set(arg)
        elif name == "/stats":
            self._stats()
        return False

    def _set(self, arg: str) -> None:
        words = arg.split()
        if len(words) != 2 or words[0] not in _SETTABLE:
            self._say(f"usage: {_USAGE['/set']}")
            return
        key, value = words
        try:
            options = {**self.options, key: _SETTABLE[key](value)}
            check_options(options)
        except InvalidRequestError as e:  # out of its range: said now, not at each message
            self._say(f"not a valid {key}: {e}")
            return
        except ValueError:
            self._say(f"not a valid {key}: {value}")
            return
        self.options = options
        self._say(f"({key} = {self.options[key]})")

    def _stats(self) -> None:
        s = self.backend.last
        if not s.generated_tokens:
            self._say("(no answer yet)" if s.complete else
                      "(no figures for the last answer: it did not finish)")
            return
        rate = s.tokens_per_second
        shown = f", {rate:.1f} tok/s" if rate is not None and s.generated_tokens > 1 else ""
        # (a server's answer with no text has no first token to time)
        ttft = "TTFT not seen" if s.ttft is None else f"TTFT {s.ttft * 1000:.0f} ms"
        self._say(f"prompt {s.prompt_tokens} tok · generation {s.generated_tokens} tok"
                  f"{shown} · {ttft}" + ("" if s.complete else " (stopped before its end)"))

    def _answer(self, text: str) -> None:
        """Stream the answer to ``text``. A failed turn (an error line) leaves the history as
        it was; a stopped one (Ctrl-C) keeps what was said."""
        self.history.append({"role": "user", "content": text})
        answer: list[str] = []
        thoughts: list[str] = []  # a reasoning model's thinking, shown dim, kept apart
        dim = getattr(self.out, "isatty", lambda: False)()
        pieces = self._fitting_answer()
        try:
            for piece in pieces:
                if isinstance(piece, Thought):
                    thoughts.append(piece)
                    self.out.write(f"\x1b[2m{piece}\x1b[0m" if dim else piece)
                else:
                    if thoughts and not answer:  # the answer on its own paragraph
                        self.out.write("\n\n")
                    answer.append(piece)
                    self.out.write(piece)
                self.out.flush()
            self._say()
        except KeyboardInterrupt:
            self._say("\n(stopped)")
        except JustLLMError as e:
            self.history.pop()  # (and the exchanges it was asked without are kept)
            self._say(("\n" if answer else "") + f"error: {e}")  # after a partial answer
            return
        finally:
            pieces.close()  # aborts an answer still running, at once
        del self.history[:self._left_out]  # answered (or stopped) without them: forgotten
        said: dict = {"role": "assistant", "content": "".join(answer)}
        if thoughts:  # the template decides whether the next prompt shows it
            said["reasoning_content"] = "".join(thoughts)
        self.history.append(said)

    def _fitting_answer(self) -> Generator[str, None, None]:
        """The answer's pieces, asked with as much of the conversation as fits the model's
        context: while the backend refuses it as too long (ContextFull, before any work: the
        engine's token count, or a server's 400), the oldest user/assistant exchange is left
        out and the request asked again. Asking is the one check that works for both backends,
        and for any server, without a tokenizer here; a refusal costs the engine or server
        one tokenization.
        Exchanges left out are said once the answer starts, and forgotten once it ends or is
        stopped (a failure mid-answer keeps them); if even the new message alone does not
        fit, the ContextFull goes up and the history stays whole."""
        skip = self._left_out = 0
        while True:
            pieces = self.backend.stream(self.messages(skip), self.options)
            try:
                first = next(pieces, None)
                break
            except ContextFull:
                if skip + 1 >= len(self.history):  # only the new message is left
                    raise
                skip += 2
        with closing(pieces):
            if skip:
                self._left_out = skip
                n = skip // 2
                which = "oldest exchange" if n == 1 else f"{n} oldest exchanges"
                self._note(f"(left out the {which} of the conversation to fit the model's "
                           "context)")
            if first is not None:
                yield first
            yield from pieces
