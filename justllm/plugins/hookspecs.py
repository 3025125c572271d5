"""The whole extension surface of justllm: one pluggy hook per way a plugin can add something.

A plugin is a Python distribution with an entry point in the ``justllm`` group whose object (a
module or a class instance) implements some of these with ``@justllm.plugins.hookimpl``. The
built-in model sources, speculation methods and routing policies are registered through the
same hooks (``builtins.py``). ``plugins/README.md`` documents every hook with an example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from justllm.core.record import RequestRecord

hookspec = pluggy.HookspecMarker("justllm")
hookimpl = pluggy.HookimplMarker("justllm")


@hookspec
def register_commands(cli: Any) -> None:
    """Add commands to the ``justllm`` command line: ``cli`` is its ``typer.Typer``
    (``@cli.command()``, ``cli.add_typer(...)``)."""


@hookspec
def register_model_sources(register: Callable[..., None]) -> None:
    """``register(source, priority=150)``: a model source (``name``, ``find(ref) -> Path |
    None``, optionally ``models() -> list[ListedModel]`` for ``justllm models``). Sources are
    tried by ascending priority; the built-in ones are path 100, registry 200, models directory
    300, Hugging Face 400, demo 500."""


@hookspec
def register_spec_methods(register: Callable[..., None]) -> None:
    """``register(SpecMethod(...))``: a speculation method ``--spec NAME`` accepts, saying
    whether a draft model proposes, whether drafts are trees, and (without a draft model) the
    proposer to build per engine."""


@hookspec
def register_routing_policies(register: Callable[..., None]) -> None:
    """``register(name, policy_class)``: a replica-selection policy for the gateway (router
    mode: ``routing: NAME`` in models.yaml); a subclass of ``Policy`` implementing ``pick``."""


@hookspec
def register_routes(app_builder: Any) -> None:
    """Extra HTTP routes on ``justllm serve`` (on every runner in router mode, whose gateway
    forwards the POST ones by model): ``app_builder.add(handler)`` with a Litestar route
    handler (``@litestar.post("/v1/rerank")``). Handlers reach the model through
    ``served(request)`` (``justllm.plugins.served``)."""


@hookspec
def on_request_finished(record: RequestRecord) -> None:
    """One call per finished request (completed, aborted or failed) with its
    ``RequestRecord``. Runs on a thread of its own per plugin, never on the engine thread: a
    plugin that raises is logged and counted, one that blocks loses records (counted) but
    slows nothing else."""
