"""Loading plugins and reading what they register.

``load_plugins()`` builds a ``Plugins`` once per command: the built-in plugin first, then every
entry point in the ``justllm`` group that ``JUSTLLM_PLUGINS`` allows. Whoever needs a registry
(the CLI's model resolution, ``--spec``, the gateway's routing, the server's routes and request
events) gets it from that object; nothing is kept in module state.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import pluggy

from justllm.plugins import builtins, hookspecs
from justllm.plugins.events import RequestEvents

if TYPE_CHECKING:
    from justllm.gateway.routing import Policy
    from justllm.models.source import ListedModel, ModelSource
    from justllm.spec.methods import SpecMethod

ENTRY_POINT_GROUP = "justllm"
BUILTIN = "justllm"  # the built-in plugin's name
DEFAULT_SOURCE_PRIORITY = 150  # after a path, before the registry
ENV = "JUSTLLM_PLUGINS"


@dataclass(frozen=True)
class PluginInfo:
    name: str
    version: str
    hooks: tuple[str, ...]


@dataclass(frozen=True)
class RouteList:
    """What ``register_routes`` gets: ``add(handler)`` appends a Litestar route handler."""

    handlers: list[Any]

    def add(self, handler: Any) -> None:
        self.handlers.append(handler)


class Plugins:
    """A loaded set of plugins and the registries they fill. ``problems`` holds one line per
    plugin that failed to load or to register something (printed by the CLI, logged by a
    server); such a plugin is skipped, never fatal."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.pm.register(builtins, name=BUILTIN)
        self.problems: list[str] = []
        self._versions: dict[str, str] = {BUILTIN: _version("justllm")}

    def register(self, plugin: object, name: str | None = None, version: str = "") -> str:
        """Register a plugin object (a module or an instance with hookimpls): entry points
        go through here, and tests register theirs directly. Registries read later see it."""
        try:
            registered = self.pm.register(plugin, name=name)
            self.pm.check_pending()  # a hookimpl that names no hook is an error
        except Exception:
            if name is not None and self.pm.get_plugin(name) is not None:
                self.pm.unregister(name=name)
            raise
        assert registered is not None, f"plugin {name} is registered already"
        self._versions[registered] = version
        self._forget()
        return registered

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._forget()

    def _forget(self) -> None:
        for key in ("_sources", "spec_methods", "routing_policies"):
            self.__dict__.pop(key, None)

    # ---- calling a hook ---------------------------------------------------------------------

    def _each(self, hook: str, **kwargs: Any) -> None:
        """Call every implementation of ``hook`` in registration order (built-ins first, so a
        plugin cannot take a built-in name); one that raises is reported and skipped."""
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            try:
                impl.function(**kwargs)
            except Exception as e:
                self.problems.append(f"plugin {impl.plugin_name}: {hook} failed: "
                                     f"{type(e).__name__}: {e}")

    def _named(self, hook: str, what: str, entry: Callable[..., tuple[str, Any]]
               ) -> dict[str, Any]:
        """A name -> thing registry filled through ``hook``'s ``register`` argument; ``entry``
        turns register's arguments into (name, thing) and raises on bad ones."""
        table: dict[str, Any] = {}
        owners: dict[str, str] = {}
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            def register(*args: Any, _plugin: str = impl.plugin_name, **kw: Any) -> None:
                name, thing = entry(*args, **kw)
                if name in table:
                    self.problems.append(f"plugin {_plugin}: {what} '{name}' is registered "
                                         f"already (by {owners[name]}); ignored")
                    return
                table[name], owners[name] = thing, _plugin
            try:
                impl.function(register=register)
            except Exception as e:
                self.problems.append(f"plugin {impl.plugin_name}: {hook} failed: "
                                     f"{type(e).__name__}: {e}")
        return table

    # ---- the registries -----------------------------------------------------------------------

    @cached_property
    def _sources(self) -> tuple[tuple[int, int, ModelSource], ...]:
        found: list[tuple[int, int, ModelSource]] = []

        def register(source: ModelSource, priority: int = DEFAULT_SOURCE_PRIORITY) -> None:
            if not isinstance(getattr(source, "name", None), str) or \
                    not callable(getattr(source, "find", None)):
                raise TypeError("a model source needs a name and a find(ref) method")
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise TypeError(f"model source {source.name}: priority must be an integer")
            found.append((priority, len(found), source))  # names need not be unique

        self._each("register_model_sources", register=register)
        return tuple(sorted(found, key=lambda t: (t[0], t[1])))

    def model_sources(self) -> tuple[ModelSource, ...]:
        """Every source, in the order a reference is tried (priority, then registration)."""
        return tuple(s for _, _, s in self._sources)

    def resolve_model(self, model: str | None) -> str:
        """``models.source.resolve_model`` over every registered source."""
        from justllm.models.source import resolve_model

        return resolve_model(model, self.model_sources())

    def plugin_model(self, ref: str) -> str | None:
        """The file a plugin's own model source (not a built-in one) gives ``ref``, asked in
        the sources' order; None when none knows it. For the commands that look a name up in
        the registry and the models directory themselves (``show``, ``tag``, ``rm``) and must
        not download, as the built-in Hugging Face source would."""
        from justllm.models.source import BUILTIN_SOURCES

        builtin = {id(source) for source, _ in BUILTIN_SOURCES}
        for source in self.model_sources():
            if id(source) not in builtin:
                found = source.find(ref)
                if found is not None:
                    return str(found)
        return None

    def served_name(self, model: str | None) -> str | None:
        """The model id ``justllm serve MODEL`` answers to when a source names it (a source's
        optional ``served_name(ref)``: ``ollama:llama3.2`` -> ``llama3.2``, where the file is
        ``sha256-...``); None: the file's stem."""
        if model is None:
            return None
        for source in self.model_sources():
            namer = getattr(source, "served_name", None)
            name = namer(model) if namer is not None else None
            if name:
                return str(name)
        return None

    def listed_models(self) -> list[tuple[str, ListedModel]]:
        """(source name, model) for each model a source with ``models()`` lists."""
        rows: list[tuple[str, ListedModel]] = []
        for source in self.model_sources():
            lister = getattr(source, "models", None)
            if lister is None:
                continue
            try:
                rows.extend((source.name, m) for m in lister())
            except Exception as e:
                self.problems.append(f"model source {source.name}: listing failed: "
                                     f"{type(e).__name__}: {e}")
        return rows

    @cached_property
    def spec_methods(self) -> Mapping[str, SpecMethod]:
        from justllm.spec.methods import SpecMethod

        def entry(method: SpecMethod) -> tuple[str, Any]:
            if not isinstance(method, SpecMethod):
                raise TypeError("register_spec_methods takes SpecMethod(...) entries")
            if not method.draft_model and method.proposer is None:
                raise TypeError(f"spec method {method.name}: without a draft model it needs "
                                "a proposer")
            return method.name, method

        return MappingProxyType(self._named("register_spec_methods", "spec method", entry))

    @cached_property
    def routing_policies(self) -> Mapping[str, type[Policy]]:
        from justllm.gateway.routing import Policy

        def entry(name: str, policy: type[Policy]) -> tuple[str, Any]:
            if not (isinstance(policy, type) and issubclass(policy, Policy)):
                raise TypeError(f"routing policy {name}: not a subclass of Policy")
            return name, policy

        return MappingProxyType(self._named("register_routing_policies", "routing policy",
                                            entry))

    def add_commands(self, cli: Any) -> None:
        self._each("register_commands", cli=cli)

    def routes(self) -> list[Any]:
        routes = RouteList([])
        self._each("register_routes", app_builder=routes)
        return routes.handlers

    def request_events(self) -> RequestEvents | None:
        """The ``on_request_finished`` dispatcher, or None when no plugin implements it."""
        impls = [(impl.plugin_name, impl.function)
                 for impl in self.pm.hook.on_request_finished.get_hookimpls()]
        return RequestEvents(impls) if impls else None

    def info(self, include_builtin: bool = False) -> list[PluginInfo]:
        out = []
        for name, plugin in self.pm.list_name_plugin():
            if name == BUILTIN and not include_builtin:
                continue
            hooks = tuple(sorted(h.name for h in self.pm.get_hookcallers(plugin) or ()))
            out.append(PluginInfo(name, self._versions.get(name, ""), hooks))
        return sorted(out, key=lambda p: (p.name != BUILTIN, p.name))


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def load_plugins(environ: Mapping[str, str] | None = None) -> Plugins:
    """The built-in plugin and the installed ones ``JUSTLLM_PLUGINS`` allows (unset: all; a
    comma list of distribution or entry point names; empty: none). A plugin that fails to
    import or register is a line in ``problems`` and is skipped."""
    environ = os.environ if environ is None else environ
    plugins = Plugins()
    allowed = environ.get(ENV)
    wanted = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
    seen: set[str] = set()
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
                     key=lambda ep: ep.name):
        dist = ep.dist.name if ep.dist is not None else ep.name
        names = {dist, ep.name}
        if wanted is not None and not names & wanted:
            continue
        seen |= names
        if plugins.pm.get_plugin(dist) is not None:
            continue  # one distribution installed twice on the path
        try:
            plugins.register(ep.load(), name=dist,
                             version=ep.dist.version if ep.dist is not None else "")
        except Exception as e:
            plugins.problems.append(f"plugin {dist} failed to load: {type(e).__name__}: {e}")
    for missing in sorted((wanted or set()) - seen):
        plugins.problems.append(f"{ENV} names {missing}, which is not installed")
    return plugins
