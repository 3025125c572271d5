"""A sample justllm plugin for the core tests: one implementation of every hook.

Installed for a test by putting this folder on the path (``PYTHONPATH`` for a subprocess): the
``justllm_sample-0.3.dist-info`` beside it declares the entry point, as pip would.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from litestar import Request, post

from justllm.plugins import DraftRequest, DraftTree, hookimpl

PREFIX = "sample:"


class SampleSource:
    """``sample:demo`` is the demo model, served as ``demo``."""

    name = "sample"

    def find(self, ref: str):
        if ref != PREFIX + "demo":
            return None
        from justllm.models.source import demo_model_path

        return demo_model_path()

    def models(self) -> list:
        from justllm.models.source import demo_model_path
        from justllm.plugins import ListedModel

        return [ListedModel(PREFIX + "demo", demo_model_path())]

    def served_name(self, ref: str) -> str | None:
        return ref[len(PREFIX):] if ref.startswith(PREFIX) else None


class PeriodProposer:
    """Proposes that text which just repeated with a short period goes on repeating (unlike
    n-gram lookup, it needs two whole periods, and proposes the cycle itself)."""

    costly = False

    def propose(self, wants: list[DraftRequest]) -> dict[str, DraftTree]:
        out = {}
        for w in wants:
            t = w.tokens
            for p in range(1, 9):
                if len(t) >= 2 * p and t[-p:] == t[-2 * p:-p]:
                    cycle = t[-p:]
                    draft = [cycle[i % p] for i in range(w.k)]
                    out[w.request_id] = DraftTree.chain(draft, wanted=w.k)
                    break
        return out

    def release(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


@hookimpl
def register_commands(cli: Any) -> None:
    @cli.command("sample-hello")
    def hello(name: str = "world") -> None:
        """Say hello (the sample plugin's command)."""
        print(f"hello {name}")


@hookimpl
def register_model_sources(register: Callable[..., None]) -> None:
    register(SampleSource(), priority=150)


@hookimpl
def register_spec_methods(register: Callable[..., None]) -> None:
    from justllm.plugins import SpecMethod

    register(SpecMethod("period", draft_model=False, proposer=PeriodProposer))


@hookimpl
def register_routing_policies(register: Callable[..., None]) -> None:
    from justllm.plugins import Decision, Policy

    class LastReplica(Policy):
        def pick(self, request, available, replicas):
            return Decision(available[-1].id, "last")

    register("last", LastReplica)


@post("/v1/sample/tokenize", status_code=200)
async def tokenize(request: Request, data: dict[str, Any]) -> dict[str, Any]:
    from justllm.plugins import served

    model = served(request)
    return {"model": model.model_id, "tokens": model.aengine.tokenize(data["text"])}


@post("/v1/sample/count/{word:str}", status_code=200)
async def count(request: Request, word: str, data: dict[str, Any],
                lower: bool = False) -> dict[str, Any]:
    """How often ``word`` is in the body's text (a route with a path parameter, and a query
    parameter: ``?lower=true`` counts regardless of case)."""
    words = data["text"].lower().split() if lower else data["text"].split()
    return {"word": word, "count": words.count(word)}


@hookimpl
def register_routes(app_builder: Any) -> None:
    app_builder.add(tokenize)
    app_builder.add(count)


@hookimpl
def on_request_finished(record: Any) -> None:
    path = os.environ.get("JUSTLLM_SAMPLE_RECORDS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(dataclasses.asdict(record)) + "\n")
