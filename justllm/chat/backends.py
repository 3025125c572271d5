"""Where the chat's answers come from: an in-process engine or an OpenAI-compatible server.

Both stream text pieces and record the speed of the last answer; closing the stream early
(Ctrl-C) aborts the request, so the model stops computing at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import httpx

from justllm.core.record import RequestRecord
from justllm.errors import JustLLMError


class RequestSink(Protocol):
    """``justllm.plugins.events.RequestEvents``: takes records without blocking."""

    def __call__(self, record: RequestRecord) -> None: ...

    def close(self, timeout: float = 5.0) -> None: ...


@dataclass
class AnswerStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft: float = 0.0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        gen_time = self.seconds - self.ttft
        return (self.generated_tokens - 1) / gen_time if gen_time > 0 and self.generated_tokens > 1 else 0.0


class LocalChat:
    """The engine on this thread (the only caller of llama.cpp), stepped while streaming."""

    def __init__(self, config, events: RequestSink | None = None) -> None:
        """``events``: where a record of each answer goes (plugins' on_request_finished)."""
        from justllm.engine.chat_template import ChatTemplate
        from justllm.engine.engine import Engine

        self.engine = Engine(config)
        self.events = events
        self.engine.observe(events)
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
        """The answer's text pieces, without its leading and trailing blanks."""
        from justllm.core.sampling_params import SamplingParams
        from justllm.engine.chat_template import AnswerText, with_template_stops

        params = SamplingParams(**options)
        params = replace(params, stop=with_template_stops(params.stop, self.template))
        prompt = self.template.render(messages, add_generation_prompt=True)
        rid = self.engine.add_request(prompt, params)
        start = time.perf_counter()
        done = False
        answer = AnswerText()
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    if out.error:
                        raise JustLLMError(out.error)
                    m = out.metrics
                    self.last = AnswerStats(m.num_prompt_tokens, m.num_generated_tokens,
                                            m.ttft or 0.0, time.perf_counter() - start)
                    done = out.finished
                    text = answer.feed(out.text)
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


class RemoteChat:
    """``/v1/chat/completions`` with streaming on a running server."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=httpx.Timeout(600, connect=10), headers=headers,
                                   trust_env=False)
        self.model = model
        self.last = AnswerStats()
        try:
            r = self.client.get(self.url + "/v1/models")
        except httpx.HTTPError as e:
            raise JustLLMError(f"cannot reach {self.url}: {e}") from None
        if r.status_code != 200:
            raise JustLLMError(f"{self.url}/v1/models answered {r.status_code}")
        self.model = self.model or r.json()["data"][0]["id"]

    def stream(self, messages: list[dict], options: dict) -> Iterator[str]:
        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **options}
        if body.get("seed") is None:
            body.pop("seed", None)
        start = time.perf_counter()
        first = None
        pieces = 0
        with self.client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                msg = r.read().decode("utf-8", "replace")
                try:
                    msg = json.loads(msg)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                raise JustLLMError(f"the server answered {r.status_code}: {msg}")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    u = data["usage"]
                    self.last = AnswerStats(u["prompt_tokens"], u["completion_tokens"],
                                            (first or start) - start, time.perf_counter() - start)
                for choice in data.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        first = first or time.perf_counter()
                        pieces += 1
                        yield text

    def close(self) -> None:
        self.client.close()
