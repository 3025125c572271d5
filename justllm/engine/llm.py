"""The offline Python API: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass, replace

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
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
        # (a tuple of them, as prompts may be one, was taken for a single SamplingParams)
        plist = (list(params) if isinstance(params, (list, tuple))
                 else [params or SamplingParams()] * len(batch))
        if len(plist) != len(batch):
            raise ValueError("one SamplingParams per prompt, or one for all")
        with self._turn:
            if self._closed:
                raise EngineClosedError("this LLM is closed")
            return self._generate(batch, plist)

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
