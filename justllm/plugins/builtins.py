"""The built-in plugin: justllm's own model sources, speculation methods and routing policies,
registered through the same hooks as anyone else's (so a plugin's entries sit among them)."""

from __future__ import annotations

from collections.abc import Callable

from justllm.plugins.hookspecs import hookimpl


@hookimpl
def register_model_sources(register: Callable[..., None]) -> None:
    from justllm.models.source import BUILTIN_SOURCES

    for source, priority in BUILTIN_SOURCES:
        register(source, priority=priority)


@hookimpl
def register_spec_methods(register: Callable[..., None]) -> None:
    from justllm.spec.methods import SPEC_METHODS

    for method in SPEC_METHODS.values():
        register(method)


@hookimpl
def register_routing_policies(register: Callable[..., None]) -> None:
    from justllm.gateway.routing import POLICIES

    for name, policy in POLICIES.items():
        register(name, policy)
