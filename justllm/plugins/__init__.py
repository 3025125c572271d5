"""justllm's plugin system (pluggy; entry point group ``justllm``). What a plugin imports:

- ``hookimpl``: the marker for hook implementations (the hooks: ``hookspecs.py``);
- ``RequestRecord``: what ``on_request_finished`` gets;
- ``ModelSource``, ``ListedModel``: a model source and a model it lists;
- ``SpecMethod``, ``Proposer``, ``DraftRequest``, ``DraftTree``: a speculation method, its
  proposer, what the proposer is asked and what it answers;
- ``Policy``, ``RouteRequest``, ``ReplicaLoad``, ``Decision``: a routing policy;
- ``served``: the loaded model (its ``AsyncEngine``, ``model_id``) from a route handler.

``load_plugins()`` / ``Plugins`` are for justllm itself and for tests.
"""

from justllm.core.record import RequestRecord
from justllm.plugins.hookspecs import hookimpl
from justllm.plugins.manager import ENTRY_POINT_GROUP, PluginInfo, Plugins, load_plugins

__all__ = ["ENTRY_POINT_GROUP", "PluginInfo", "Plugins", "RequestRecord", "hookimpl",
           "load_plugins", "ListedModel", "ModelSource", "SpecMethod", "Proposer", "DraftRequest",
           "DraftTree",
           "Policy", "RouteRequest", "ReplicaLoad", "Decision", "served"]


def __getattr__(name: str) -> object:
    """The rest on first use: importing ``justllm.plugins`` stays cheap for every command."""
    if name in ("ListedModel", "ModelSource"):
        from justllm.models import source
        return getattr(source, name)
    if name == "SpecMethod":
        from justllm.spec.methods import SpecMethod
        return SpecMethod
    if name in ("Proposer", "DraftRequest"):
        from justllm.spec import proposer
        return getattr(proposer, name)
    if name == "DraftTree":
        from justllm.core.plan import DraftTree
        return DraftTree
    if name in ("Policy", "RouteRequest", "ReplicaLoad", "Decision"):
        from justllm.gateway import routing
        return getattr(routing, name)
    if name == "served":
        from justllm.server.app import served
        return served
    raise AttributeError(f"module 'justllm.plugins' has no attribute {name!r}")
