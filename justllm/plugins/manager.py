"""Loading plugins and reading what they register.

``load_plugins()`` builds a ``Plugins`` once per command: the built-in plugin first, then every
entry point in the ``justllm`` group that ``JUSTLLM_PLUGINS`` allows. Whoever needs a registry
(the CLI's model resolution, ``--spec``, the gateway's routing, the server's routes and request
events) gets it from that object; nothing is kept in module state.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import pluggy

from justllm.errors import JustLLMError
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


@dataclass
class RouteList:
    """What ``register_routes`` gets: ``add(handler)`` appends a Litestar route handler.
    ``owners`` says which plugin added each (by the handler's id), for the warnings about a
    route left out."""

    handlers: list[Any]
    owners: dict[int, str] = field(default_factory=dict)
    plugin: str = ""  # whose hook runs now

    def add(self, handler: Any) -> None:
        from litestar.handlers import BaseRouteHandler

        if not isinstance(handler, BaseRouteHandler):
            raise TypeError(f"app_builder.add takes a Litestar route handler "
                            f"(@litestar.get/post/...), not {type(handler).__name__}")
        self.handlers.append(handler)
        self.owners[id(handler)] = self.plugin


class Plugins:
    """A loaded set of plugins and the registries they fill. ``problems`` holds one line per
    plugin that failed to load or to register something (printed by the CLI, logged by a
    server); such a plugin is skipped, never fatal."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.pm.register(builtins, name=BUILTIN)
        self.problems: list[str] = []
        self.shown = 0  # how many of the problems the command line has printed
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

    def _impls(self, hook: str) -> list[Any]:
        """``hook``'s implementations in registration order: built-ins first, so a plugin
        cannot take a built-in name. (pluggy's own list puts ``trylast`` ones first and
        ``tryfirst`` ones last, which would let a plugin's ``trylast`` go before the
        built-ins.)"""
        order = {name: i for i, (name, _) in enumerate(self.pm.list_name_plugin())}
        impls = []
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if impl.hookwrapper or getattr(impl, "wrapper", False):  # (called as a function,
                line = (f"plugin {impl.plugin_name}: its {hook} is a hook wrapper, which "
                        "justllm does not run: left out")  # its body never ran, unsaid)
                if line not in self.problems:
                    self.problems.append(line)
                continue
            impls.append(impl)
        return sorted(impls, key=lambda impl: order.get(impl.plugin_name, len(order)))

    def _call(self, impl: Any, hook: str, **kwargs: Any) -> None:
        """One implementation, with the arguments it names (pluggy lets an implementation
        leave out those it does not use); one that raises, or exits, is reported."""
        try:
            impl.function(**{k: v for k, v in kwargs.items() if k in impl.argnames})
        except (Exception, SystemExit) as e:
            self.problems.append(f"plugin {impl.plugin_name}: {hook} failed: "
                                 f"{type(e).__name__}: {e}")

    def _each(self, hook: str, **kwargs: Any) -> None:
        """Call every implementation of ``hook`` in registration order (:meth:`_impls`); one
        that raises is reported and skipped."""
        for impl in self._impls(hook):
            self._call(impl, hook, **kwargs)

    def _named(self, hook: str, what: str, entry: Callable[..., tuple[str, Any]]
               ) -> dict[str, Any]:
        """A name -> thing registry filled through ``hook``'s ``register`` argument; ``entry``
        turns register's arguments into (name, thing) and raises on bad ones."""
        table: dict[str, Any] = {}
        owners: dict[str, str] = {}
        for impl in self._impls(hook):
            def register(*args: Any, _plugin: str = impl.plugin_name, **kw: Any) -> None:
                name, thing = entry(*args, **kw)
                if name in table:
                    self.problems.append(f"plugin {_plugin}: {what} '{name}' is registered "
                                         f"already (by {owners[name]}); ignored")
                    return
                table[name], owners[name] = thing, _plugin
            self._call(impl, hook, register=register)
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

        for impl in self._impls("register_model_sources"):
            before = len(found)
            self._call(impl, "register_model_sources", register=register)
            if impl.plugin_name != BUILTIN:  # a plugin's source may fail: it is skipped
                found[before:] = [(p, i, GuardedSource(src, impl.plugin_name, self.problems))
                                  for p, i, src in found[before:]]
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
        for source in self._plugin_sources():
            found = source.find(ref)
            if found is not None:
                return str(found)
        return None

    def claims(self, ref: str) -> bool:
        """Whether a plugin's own model source reads ``ref`` as one of its models (it finds
        it, or says why it cannot: ``ollama:foo`` with no such Ollama model)."""
        for source in self._plugin_sources():
            try:
                if source.find(ref) is not None:
                    return True
            except (JustLLMError, ValueError):
                return True
        return False

    def _plugin_sources(self) -> Iterator[ModelSource]:
        """The model sources plugins registered (not the built-in ones), in their order."""
        from justllm.models.source import BUILTIN_SOURCES

        builtin = {id(source) for source, _ in BUILTIN_SOURCES}
        return (source for source in self.model_sources() if id(source) not in builtin)

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
        """Each plugin's commands; one with the name of a command there already (a built-in
        one, or an earlier plugin's) is left out with a problem line."""
        for impl in self._impls("register_commands"):
            taken = _command_names(cli)
            commands, groups = len(cli.registered_commands), len(cli.registered_groups)
            callback = cli.registered_callback
            self._call(impl, "register_commands", cli=cli)
            if cli.registered_callback is not callback:  # (--version, --help's text: gone)
                cli.registered_callback = callback
                self.problems.append(f"plugin {impl.plugin_name}: it replaced justllm's own "
                                     "options (cli.callback); left out")
            for registered, start in ((cli.registered_commands, commands),
                                      (cli.registered_groups, groups)):
                for info in list(registered[start:]):
                    name = _command_name(info)
                    if name in taken:
                        registered.remove(info)
                        self.problems.append(f"plugin {impl.plugin_name}: the command '{name}' "
                                             "exists already; left out")
                    taken.add(name)

    def routes(self) -> list[Any]:
        return self.route_list().handlers

    def route_list(self) -> RouteList:
        """The plugins' route handlers, with the plugin that added each."""
        routes = RouteList([])
        for impl in self._impls("register_routes"):
            routes.plugin = impl.plugin_name
            self._call(impl, "register_routes", app_builder=routes)
        return routes

    def request_events(self) -> RequestEvents | None:
        """The ``on_request_finished`` dispatcher, or None when no plugin implements it."""
        impls = [(impl.plugin_name, impl.function if "record" in impl.argnames
                  else _ignoring_record(impl.function))
                 for impl in self._impls("on_request_finished")]
        return RequestEvents(impls) if impls else None

    def info(self, include_builtin: bool = False) -> list[PluginInfo]:
        out = []
        for name, plugin in self.pm.list_name_plugin():
            if name == BUILTIN and not include_builtin:
                continue
            hooks = tuple(sorted(h.name for h in self.pm.get_hookcallers(plugin) or ()))
            out.append(PluginInfo(name, self._versions.get(name, ""), hooks))
        return sorted(out, key=lambda p: (p.name != BUILTIN, p.name))


def _command_name(info: Any) -> str:
    """The name Typer gives a registered command or group (its own, else its function's)."""
    if info.name:
        return str(info.name)
    typer_instance = getattr(info, "typer_instance", None)
    if typer_instance is not None and typer_instance.info.name:
        return str(typer_instance.info.name)
    callback = info.callback
    return callback.__name__.lower().replace("_", "-") if callback is not None else ""


def _command_names(cli: Any) -> set[str]:
    return {_command_name(i) for i in [*cli.registered_commands, *cli.registered_groups]}


def _ignoring_record(fn: Callable[..., object]) -> Callable[..., object]:
    """An ``on_request_finished`` that takes no argument, called as the others are."""
    return lambda record: fn()


class GuardedSource:
    """A plugin's model source whose failures skip it: ``find`` or ``served_name`` raising
    anything but the errors meant for the user (``JustLLMError`` such as ``ModelLoadError``,
    ``ValueError``: a reference that is the source's but broken), or ``find`` giving
    something that is not a path, is a problem line (once per source) and counts as "not
    mine", so the other sources still answer (``models`` is guarded where it is listed)."""

    def __init__(self, source: Any, plugin: str, problems: list[str]) -> None:
        self.source, self.plugin, self._problems = source, plugin, problems
        self.name = source.name
        self._reported = False
        if callable(getattr(source, "models", None)):
            self.models = source.models
        if callable(getattr(source, "served_name", None)):
            self.served_name = self._served_name

    def _failed(self, what: str, why: str) -> None:
        line = f"plugin {self.plugin}: model source {self.name}: {what} {why}; skipped"
        if not self._reported:
            self._reported = True
            self._problems.append(line)

    def find(self, ref: str) -> Any:
        try:
            found = self.source.find(ref)
        except (JustLLMError, ValueError):  # "yours, but broken": the user's error line
            raise
        except (Exception, SystemExit) as e:
            self._failed("find", f"failed: {type(e).__name__}: {e}")
            return None
        if found is not None and not isinstance(found, str | os.PathLike):
            self._failed("find", f"gave a {type(found).__name__}, not a path")
            return None
        return found

    def _served_name(self, ref: str) -> str | None:
        try:
            name = self.source.served_name(ref)
        except (Exception, SystemExit) as e:
            self._failed("served_name", f"failed: {type(e).__name__}: {e}")
            return None
        return name if isinstance(name, str) else None


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
    # (names as pip compares them: justllm_ollama and JustLLM-Ollama are justllm-ollama)
    given = {_normal(n.strip()): n.strip() for n in (allowed or "").split(",") if n.strip()}
    wanted = None if allowed is None else set(given)
    seen: set[str] = set()
    loaded: set[tuple[str, str]] = set()
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
                     key=lambda ep: ep.name):
        dist = ep.dist.name if ep.dist is not None else ep.name
        names = {_normal(dist), _normal(ep.name)}
        if wanted is not None and not names & wanted:
            continue
        seen |= names
        if (dist, ep.name) in loaded:
            continue  # one distribution installed twice on the path
        loaded.add((dist, ep.name))
        # A distribution's first entry point is registered under its name; any other one
        # under DIST:ENTRY_POINT.
        name = dist if plugins.pm.get_plugin(dist) is None else f"{dist}:{ep.name}"
        try:
            plugins.register(ep.load(), name=name,
                             version=ep.dist.version if ep.dist is not None else "")
        except (Exception, SystemExit) as e:  # sys.exit() in a plugin's import too
            plugins.problems.append(f"plugin {name} failed to load: {type(e).__name__}: {e}")
    for missing in sorted((wanted or set()) - seen):
        plugins.problems.append(f"{ENV} names {given[missing]}, which is not installed")
    return plugins


def _normal(name: str) -> str:
    """A distribution name as PEP 503 compares them (pip's normalisation)."""
    return re.sub(r"[-_.]+", "-", name).lower()
