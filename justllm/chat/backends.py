"""Where the chat's answers come from: an in-process engine or an OpenAI-compatible server.

Both stream text pieces and record the speed of the last answer; closing the stream early
(Ctrl-C) aborts the request, so the model stops computing at once. Both raise ContextFull,
before any text, for a conversation that does not fit the model's context, so that the chat
can leave out its oldest exchanges and ask again.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import httpx

from justllm.core.http_errors import error_text
from justllm.core.record import RequestRecord
from justllm.core.sse import sse_data
from justllm.errors import JustLLMError


class RequestSink(Protocol):
    """``justllm.plugins.events.RequestEvents``: takes records without blocking."""

    def __call__(self, record: RequestRecord) -> None: ...

    def close(self, timeout: float = 5.0) -> None: ...


class Thought(str):
    """A piece of a reasoning model's thinking (what it writes before its answer, between its
    thinking tags): the chat shows it apart and keeps it out of the answer's text."""


class ContextFull(JustLLMError):
    """The conversation plus the answer's ``max_tokens`` does not fit the model's context;
    refused before any work, so asking again with fewer messages is safe."""


@dataclass
class AnswerStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # None: not seen (a server's stream whose answer had no text to time its first token by)
    ttft: float | None = 0.0
    seconds: float = 0.0
    complete: bool = True  # False: stopped or failed before its end (figures so far, if any)

    @property
    def tokens_per_second(self) -> float | None:
        """After the first token; None when its time was not seen (the whole request's time
        would count the prompt's as generation's)."""
        if self.ttft is None:
            return None
        gen_time = self.seconds - self.ttft
        return (self.generated_tokens - 1) / gen_time if gen_time > 0 and self.generated_tokens > 1 else 0.0


def _aliases(card: dict) -> list[str]:
    """The other names a model card says its model answers to (router mode's ``aliases``)."""
    aliases = card.get("aliases")
    return [str(a) for a in aliases] if isinstance(aliases, list) else []


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _text(delta: dict, key: str) -> str | None:
    """A chunk's ``delta[key]``: text or nothing; anything else is no chat stream (a number
    was written out as it came, and failed with a traceback)."""
    value = delta.get(key)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"its {key} is a {type(value).__name__}, not text")
    return value


class LocalChat:
    """The engine on this thread (the only caller of llama.cpp), stepped while streaming."""

    def __init__(self, config, events: RequestSink | None = None, *,
                 record_text: bool = False, model_id: str | None = None) -> None:
        """``events``: where a record of each answer goes (plugins' on_request_finished),
        with its prompt and answer text if ``record_text``, naming the model ``model_id``
        (default: the GGUF file's stem)."""
        from justllm.engine.chat_template import ChatTemplate
        from justllm.engine.engine import Engine

        self.engine = Engine(config)
        self.events = events
        self.engine.observe(events, model=model_id, text=record_text)
        # Each answer's own id (records, justllm history --id): the engine's req-N began
        # again at req-0 in every chat
        self._session = f"chat-{secrets.token_hex(6)}"
        self._answers = 0
        try:
            self.template = ChatTemplate.from_backend(self.engine.backend, config.chat_template)
        except BaseException:
            self.engine.close()
            raise
        self.last = AnswerStats()

    @property
    def notice(self) -> str | None:
        """Something to tell the user once, before the chat starts (a model without a chat
        template is chatted with as a plain transcript)."""
        return self.template.notice

    def stream(self, messages: list[dict], options: dict) -> Iterator[str]:
        """The answer's text pieces, without its leading and trailing blanks. ContextFull is
        the engine's own refusal of a prompt that does not fit (add_request counts it with the
        model's tokenizer before queuing anything): the same check, and the same words, as a
        server's 400."""
        from justllm.core.sampling_params import SamplingParams
        from justllm.engine.chat_template import AnswerText, with_template_stops
        from justllm.errors import InvalidRequestError

        params = SamplingParams(**options)
        params = replace(params, stop=with_template_stops(params.stop, self.template))
        prompt = self.template.render(messages, add_generation_prompt=True)
        self.last = AnswerStats(complete=False)  # until its first output
        try:
            rid = self.engine.add_request(prompt, params,
                                          request_id=f"{self._session}-{self._answers}")
            self._answers += 1
        except InvalidRequestError as e:
            if about_context(e.param, str(e)):
                raise ContextFull(str(e)) from None
            raise
        start = time.perf_counter()
        done = False
        answer = AnswerText()
        thinking = self.template.thinking_reader(prompt)
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    if out.error:
                        raise JustLLMError(out.error)
                    m = out.metrics
                    self.last = AnswerStats(m.num_prompt_tokens, m.num_generated_tokens,
                                            m.ttft or 0.0, time.perf_counter() - start,
                                            complete=out.finished)
                    done = out.finished
                    text = out.text
                    if thinking is not None:
                        thought, text = thinking.feed(text)
                        if out.finished:
                            more, rest = thinking.finish()
                            thought, text = thought + more, text + rest
                        if thought:
                            yield Thought(thought)
                    text = answer.feed(text)
                    if text:
                        yield text
        finally:
            if not done:
                self.engine.abort(rid)
                self.engine.step()  # drop its KV now

    def close(self) -> None:
        self.engine.close()
        if self.events is not None:
            self.events.close()


def about_context(param: str | None, message: str) -> bool:
    """A refusal for the context length: this engine's names ``param`` prompt or max_tokens
    and says "context" (another of its refusals of a prompt does not)."""
    return param in ("prompt", "max_tokens", "messages") and "context" in message


def check_url(url: str, flag: str = "--url") -> str:
    """``url`` as given, or a ValueError naming ``flag`` for an address no request could go to.
    Checked before anything runs: httpx raises InvalidURL (no HTTPError) for a malformed one
    (``http://[::1``), a port beyond 65535 fails only in the socket (OverflowError), and a
    host name with an empty or overlong label in the resolver (UnicodeError)."""
    if not url.lower().startswith(("http://", "https://")):
        raise ValueError(f"{flag} must start with http:// or https://, got {url!r}")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(f"{flag} {url!r} is not a valid URL: {e}") from None
    if not parsed.host:
        raise ValueError(f"{flag} {url!r} names no host")
    if parsed.query or parsed.fragment or url.rstrip().endswith(("?", "#")):
        # (the routes were appended after it: every request went to "...?x=1/v1/...")
        raise ValueError(f"{flag} {url!r}: a server's address has no query or fragment "
                         "(?... or #...)")
    if parsed.port is not None and not 0 < parsed.port <= 65535:
        raise ValueError(f"{flag} {url!r}: the port must be in 1-65535 (got {parsed.port})")
    try:
        parsed.host.encode("idna")  # as the resolver will (an IPv6 address passes)
    except UnicodeError:
        raise ValueError(f"{flag} {url!r}: {parsed.host!r} is not a valid host name") from None
    return url


def remote_base(url: str) -> str:
    """The server's root: OpenAI clients are configured with ``.../v1``, and the chat and
    ``justllm bench`` add ``/v1/...`` (and ``/metrics``) themselves."""
    return url.rstrip("/").removesuffix("/v1")


def encodable(text: str) -> str:
    """``text`` as UTF-8 can carry it: undecodable input bytes (surrogate escapes) become "?",
    as the local engine's tokenizer turns them (encode with errors="replace")."""
    return text.encode("utf-8", "replace").decode("utf-8")


def refusal(status: int, body: bytes, content_type: str = "") -> JustLLMError:
    """The error for a non-200 answer: ContextFull for a 400 about the context length (this
    server's says so with ``param`` prompt or max_tokens; OpenAI's has the code
    context_length_exceeded), else one line with the server's message."""
    msg, error = _error_of(status, body, content_type)
    if status == 400 and isinstance(error, dict) and (
            error.get("code") == "context_length_exceeded"
            or error.get("type") == "exceed_context_size_error"  # llama-server's
            or "maximum context length" in str(msg)  # vLLM's (param null), OpenAI's
            or about_context(error.get("param"), str(msg))):
        return ContextFull(f"the server answered {status}: {msg}")
    return JustLLMError(f"the server answered {status}: {msg}")


def _error_of(status: int, body: bytes, content_type: str = "") -> tuple[str, dict]:
    """An error answer's message (OpenAI's ``error.message``, an HTML page's title, the text:
    ``error_text``) and its ``error`` object ({} without one)."""
    error: object = None
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        pass
    return error_text(status, body, content_type), error if isinstance(error, dict) else {}


def _choices(data: dict) -> list[dict]:
    """A chunk's choices, each an object with a ``delta`` object (a final chunk's may be
    empty); ValueError for anything else (a null choice or delta was an AttributeError
    traceback)."""
    choices = data.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list) or not all(
            isinstance(c, dict) and isinstance(c.get("delta", {}), dict) for c in choices):
        raise ValueError(f"choices {json.dumps(choices)[:200]} are not objects with a delta "
                         "object each")
    return [{**c, "delta": c.get("delta", {})} for c in choices]


def stream_error(error: object) -> str:
    """The line for an error event in a stream (``data: {"error": ...}``): the server's
    message, as OpenAI's error object carries it, or the event as it came."""
    message = error.get("message") if isinstance(error, dict) else error
    if not isinstance(message, str) or not message.strip():
        message = json.dumps(error)
    return f"the server failed during the answer: {message}"


class RemoteChat:
    """``/v1/chat/completions`` with streaming on a running server, with ``model`` (one of
    the ids its ``/v1/models`` lists; default: the first)."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None) -> None:
        self.url = remote_base(check_url(url))  # (a malformed one was an httpx traceback)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=httpx.Timeout(600, connect=10), headers=headers,
                                   trust_env=False)
        self.model = model
        self.listed: list[str] = []  # the ids the server's /v1/models lists
        self.context: int | None = None  # the tokens a request holds there, where it says
        self.last = AnswerStats()
        try:
            self._choose_model()
        except BaseException:
            self.client.close()
            raise

    def _choose_model(self) -> None:
        try:
            r = self.client.get(self.url + "/v1/models")
        except httpx.HTTPError as e:
            raise JustLLMError(f"cannot reach {self.url}: {e}") from None
        if r.status_code != 200:
            hint = " (--api-key, or JUSTLLM_API_KEY?)" if r.status_code == 401 else ""
            raise JustLLMError(f"{self.url}/v1/models answered {r.status_code}: "
                               f"{_error_of(r.status_code, r.content, r.headers.get('content-type', ''))[0]}"
                               f"{hint}")
        try:
            cards = r.json()["data"]
            self.listed = [str(m["id"]) for m in cards]
            # (router mode lists a model's aliases on its card: they are served too)
            names = {*self.listed, *(a for m in cards for a in _aliases(m))}
        except (ValueError, LookupError, TypeError, AttributeError):
            self.listed, names = [], set()
        if not self.listed:
            raise JustLLMError(f"{self.url}/v1/models did not list a model as an "
                               "OpenAI-compatible server does")
        if self.model is None:
            self.model = self.listed[0]
        # (vLLM's and justllm's cards say how many tokens a request holds)
        self.context = next((m["max_model_len"] for m in cards if self.model in
                             (m.get("id"), *_aliases(m)) and _is_count(m.get("max_model_len"))),
                            None)
        if self.model is not None and self.model not in names:  # (every request refused)
            shown = ", ".join(self.listed[:10]) + (", …" if len(self.listed) > 10 else "")
            raise JustLLMError(f"{self.url} serves no model named '{self.model}' (its "
                               f"/v1/models lists: {shown})")

    def stream(self, messages: list[dict], options: dict) -> Iterator[str]:
        """The answer's text pieces, without its leading and trailing blanks (as a local
        model's). A network failure, or an answer that is not the server's stream, is one
        JustLLMError; until the final chunk's usage, ``last`` says that this answer has no
        figures (a stopped one must not show the previous answer's)."""
        from justllm.engine.chat_template import AnswerText

        messages = [{**m, "content": encodable(m["content"]),
                     **({"reasoning_content": encodable(m["reasoning_content"])}
                        if m.get("reasoning_content") else {})} for m in messages]
        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **options}
        if body.get("seed") is None:
            body.pop("seed", None)
        self.last = AnswerStats(complete=False)
        start = time.perf_counter()
        first = None
        answer = AnswerText()
        try:
            with self.client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise refusal(r.status_code, r.read(), r.headers.get("content-type", ""))
                for line in r.iter_lines():
                    payload = sse_data(line)
                    if payload == "[DONE]":  # the end, even from a server that sends no usage
                        self.last = replace(self.last, complete=True)
                    if not payload.startswith("{"):
                        continue
                    data = json.loads(payload)
                    if data.get("error") is not None:
                        # The server failed mid-answer (justllm's own sends this event, as
                        # OpenAI's does): a failed turn, not an answer cut short.
                        raise JustLLMError(stream_error(data["error"]))
                    if data.get("usage"):
                        u = data["usage"]
                        self.last = AnswerStats(u["prompt_tokens"], u["completion_tokens"],
                                                None if first is None else first - start,
                                                time.perf_counter() - start)
                    for choice in _choices(data):
                        delta = choice["delta"]
                        thought = _text(delta, "reasoning_content")
                        if thought:
                            first = first or time.perf_counter()
                            yield Thought(thought)
                        text = _text(delta, "content")
                        if text:
                            first = first or time.perf_counter()
                        if text := answer.feed(text or ""):
                            yield text
        except httpx.ConnectError as e:
            raise JustLLMError(f"cannot reach {self.url}: {e}") from None
        except httpx.HTTPError as e:
            raise JustLLMError(f"the connection to {self.url} failed: {e or type(e).__name__}"
                               ) from None
        except (ValueError, LookupError, TypeError) as e:  # not JSON, or not a chat chunk
            raise JustLLMError(f"{self.url} sent something that is not a chat stream: {e}"
                               ) from None

    def close(self) -> None:
        self.client.close()
