"""The offline Python API: ``LLM(model).generate(prompts, params)`` and ``.chat(messages)``."""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, cast

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.chat_template import ChatTemplate, with_template_stops
from justllm.engine.engine import Engine, PreparedRequest, RequestMetrics, TokenLogprob
from justllm.errors import EngineClosedError, InvalidRequestError, QueueFullError


@dataclass(frozen=True)
class CompletionOutput:
    request_id: str
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", or "abort" when the request failed (see error)
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics
    error: str | None = None  # why the request failed (a grammar with no way forward, ...)
    stop: str | None = None  # the stop string that ended it, if one did
    # With ``prompt_logprobs``: one entry per prompt token (None for the first), and the
    # prompt's tokens they are of.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None


def _per_prompt(params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...] | None,
                n: int, what: str) -> list[SamplingParams]:
    """One SamplingParams for each of ``n`` prompts: the ones given (a list, or a tuple as the
    prompts may be one: it was taken for a single SamplingParams), or one for all."""
    plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * n
    if len(plist) != n:
        raise ValueError(f"one SamplingParams per {what}, or one for all")
    return plist


class LLM:
    """Run many prompts through one engine on the calling thread.

    ``LLM("model.gguf", max_seqs=8)`` takes any :class:`EngineConfig` field as a keyword.
    Calls from several threads take turns (one ``generate`` at a time: the engine steps on
    the caller's thread). An LLM dropped without ``close`` frees its model when it is
    collected.
    """

    def __init__(self, model: str | None = None, **config: object) -> None:
        self.engine = Engine(EngineConfig(model=model, **config))  # type: ignore[arg-type]
        self._turn = threading.Lock()
        self._closed = False
        self._template: ChatTemplate | None = None  # chat()'s, made at its first call
        self._finalizer = weakref.finalize(self, self.engine.close)

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...]
                 | None = None
                 ) -> list[CompletionOutput]:
        if not isinstance(prompts, (str, list, tuple)):
            raise InvalidRequestError("prompts must be a string, a list of token ids, or a "
                                      "list of either", param="prompt")
        batch: list[str | list[int]] = (
            [prompts] if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int))
            else list(prompts))  # type: ignore[arg-type]  # a list of prompts
        plist = _per_prompt(params, len(batch), "prompt")
        with self._turn:
            if self._closed:
                raise EngineClosedError("this LLM is closed")
            return self._generate(batch, plist)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...]
             | None = None, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[CompletionOutput]:
        """vLLM's ``LLM.chat``: one conversation (``[{"role": .., "content": ..}, ..]``) or a
        list of them, rendered with the model's chat template (or the ``chat_template`` the
        LLM was made with; a model without one gets the plain transcript, with a warning), the
        template's turn ends added to each request's stop strings, then :meth:`generate`.
        ``continue_final_message``: the answer goes on with the last (assistant) message,
        which ``add_generation_prompt`` must then leave open (False), as in vLLM. The text is
        the model's, as ``generate`` gives it (a transcript's answer begins with its blank)."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message needs add_generation_prompt "
                                      "False (the last message is continued, not answered)",
                                      param="add_generation_prompt")
        one = isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)
        conversations = cast(list[list[dict[str, Any]]], [messages] if one else messages)
        if not isinstance(conversations, (list, tuple)) or not conversations or not all(
                isinstance(c, list) and c and all(isinstance(m, dict) for m in c)
                for c in conversations):
            raise InvalidRequestError("messages must be a conversation (a non-empty list of "
                                      "message dicts) or a list of them", param="messages")
        template = self._chat_template()
        prompts = [template.render(c, add_generation_prompt=add_generation_prompt,
                                   continue_final=continue_final_message,
                                   **(chat_template_kwargs or {}))
                   for c in conversations]
        plist = [replace(p, stop=with_template_stops(p.stop, template))
                 if isinstance(p, SamplingParams) else p
                 for p in _per_prompt(params, len(prompts), "conversation")]
        return self.generate(prompts, plist)  # type: ignore[arg-type]

    def _chat_template(self) -> ChatTemplate:
        """The template conversations are rendered with (made once; says its notice once)."""
        with self._turn:
            if self._closed:
                raise EngineClosedError("this LLM is closed")
            if self._template is None:
                self._template = ChatTemplate.from_backend(self.engine.backend,
                                                           self.engine.config.chat_template)
                if self._template.notice:
                    warnings.warn(self._template.notice, stacklevel=3)
            return self._template

    def _generate(self, batch: list[str | list[int]], plist: list[SamplingParams]
                  ) -> list[CompletionOutput]:
        # Every prompt is checked first: a refused one ends the call before anything runs.
        prepared = [self.engine.prepare(p, sp) for p, sp in zip(batch, plist)]
        ids: list[str] = []
        try:
            return self._run(prepared, batch, ids)
        except BaseException:
            # Ctrl-C (or an engine error) ends the whole call: its requests are aborted, so
            # the engine is left as it was (they stayed queued and broke every later call).
            for i in ids:
                self.engine.abort(i)
            raise

    def _run(self, prepared: list[PreparedRequest], batch: list[str | list[int]],
             ids: list[str]) -> list[CompletionOutput]:
        """The prompts queued as the engine's queue (``max_queue``) takes them: a batch
        larger than it was a QueueFullError saying to retry, for a call that cannot."""
        pending = deque(range(len(prepared)))
        order: list[str] = []
        texts: dict[str, list[str]] = {}
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprob] | None] = {}
        done: dict[str, CompletionOutput] = {}
        prompt_lps: dict[str, tuple[list[TokenLogprob | None] | None, list[int] | None]] = {}
        index: dict[str, str | list[int]] = {}
        while len(done) < len(prepared):
            while pending:
                try:
                    rid = self.engine.add_request(prepared[pending[0]])
                except QueueFullError:
                    break
                k = pending.popleft()
                ids.append(rid)
                order.append(rid)
                texts[rid], tokens[rid], logprobs[rid], index[rid] = [], [], None, batch[k]
            for out in self.engine.step():
                if out.request_id not in texts:  # another caller's request on this engine
                    continue
                texts[out.request_id].append(out.text)
                tokens[out.request_id].extend(out.token_ids)
                if out.logprobs is not None:
                    logprobs[out.request_id] = (logprobs[out.request_id] or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    prompt_lps[out.request_id] = (out.prompt_logprobs, out.prompt_token_ids)
                if out.finished:
                    plp, ptok = prompt_lps.get(out.request_id, (None, None))
                    done[out.request_id] = CompletionOutput(
                        out.request_id, index[out.request_id], "".join(texts[out.request_id]),
                        tokens[out.request_id], out.finish_reason or "stop",
                        logprobs[out.request_id], replace(out.metrics), out.error, out.stop,
                        plp, ptok)
        return [done[i] for i in order]

    def close(self) -> None:
        with self._turn:
            self._closed = True
            self._finalizer()  # (once: later calls do nothing)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
