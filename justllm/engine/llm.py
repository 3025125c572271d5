"""The offline Python API: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Engine, RequestMetrics, TokenLogprob


@dataclass(frozen=True)
class CompletionOutput:
    request_id: str
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics


class LLM:
    """Run many prompts through one engine on the calling thread.

    ``LLM("model.gguf", max_seqs=8)`` takes any :class:`EngineConfig` field as a keyword.
    """

    def __init__(self, model: str | None = None, **config: object) -> None:
        self.engine = Engine(EngineConfig(model=model, **config))  # type: ignore[arg-type]

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        batch: list[str | list[int]] = (
            [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
            else list(prompts))  # type: ignore[arg-type]  # a list of prompts
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(batch)
        if len(plist) != len(batch):
            raise ValueError("one SamplingParams per prompt, or one for all")
        ids: list[str] = []
        try:
            for p, sp in zip(batch, plist):
                ids.append(self.engine.add_request(p, sp))
            return self._run(ids, batch)
        except BaseException:
            # A refused prompt (or Ctrl-C) ends the whole call: its requests are aborted, so
            # the engine is left as it was (they stayed queued and broke every later call).
            for i in ids:
                self.engine.abort(i)
            raise

    def _run(self, ids: list[str], batch: list[str | list[int]]) -> list[CompletionOutput]:
        texts: dict[str, list[str]] = {i: [] for i in ids}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list[TokenLogprob] | None] = {i: None for i in ids}
        done: dict[str, CompletionOutput] = {}
        index = dict(zip(ids, batch))
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.request_id not in texts:  # another caller's request on this engine
                    continue
                texts[out.request_id].append(out.text)
                tokens[out.request_id].extend(out.token_ids)
                if out.logprobs is not None:
                    logprobs[out.request_id] = (logprobs[out.request_id] or []) + out.logprobs
                if out.finished:
                    done[out.request_id] = CompletionOutput(
                        out.request_id, index[out.request_id], "".join(texts[out.request_id]),
                        tokens[out.request_id], out.finish_reason or "stop",
                        logprobs[out.request_id], replace(out.metrics))
        return [done[i] for i in ids]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
