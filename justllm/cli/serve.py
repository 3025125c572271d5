"""``justllm serve``: the OpenAI-compatible server on Litestar + uvicorn."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
import threading
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from justllm.cli import options as o
from justllm.cli.cleanup_shield import SigintHandler
from justllm.cli.completion import one_of, roles
from justllm.cli.errors import cli_errors
from justllm.cli.plugins import plugins_of, warn_problems
from justllm.errors import ModelLoadError
from justllm.plugins import Plugins

if TYPE_CHECKING:
    from collections.abc import Sequence

    from justllm.gateway.config import GatewayConfig, ModelSpec


@o.engine_options
def serve(
    context: typer.Context,
    models: Annotated[Optional[list[str]], typer.Argument(
        help="A .gguf path, a model name or a Hugging Face REPO[:FILE] (default: the bundled "
             "demo model). Several: router mode, each in its own runner process.",
        show_default=False, metavar="MODEL")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind.", envvar="JUSTLLM_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.", envvar="JUSTLLM_PORT")] = 8080,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Require the key on every route but /health, /metrics, /docs and / ('Authorization: Bearer KEY' or 'x-api-key: KEY').", envvar="JUSTLLM_API_KEY")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="Model id clients send (default: the file name without .gguf).")] = None,
    models_file: Annotated[Optional[str], typer.Option("--models", help="Router mode: serve every model in this YAML file (each in its own runner process, loaded on demand; see the README).", envvar="JUSTLLM_MODELS")] = None,
    models_dir: Annotated[Optional[str], typer.Option("--models-dir", help="Router mode: serve every .gguf in this directory and below, named by file stem (a split model by its name, from its first part).")] = None,
    role: Annotated[str, typer.Option("--role", autocompletion=one_of(roles), help="Prefill/decode disaggregation: 'prefill' computes prompts and exports their KV, 'decode' imports it and generates, 'both' (default) does either; every role also serves the OpenAI API whole.", envvar="JUSTLLM_ROLE")] = "both",
    record_text: Annotated[bool, typer.Option("--record-text", help="Finished-request records (plugins' on_request_finished, e.g. justllm-request-log) carry the prompt and output text.", envvar="JUSTLLM_RECORD_TEXT")] = False,
    shutdown_timeout: Annotated[float, typer.Option("--shutdown-timeout", help="On SIGTERM/SIGINT: the server stops accepting connections, and the requests in flight may still run this many seconds; then they are aborted and the server exits. 0: abort at once.", envvar="JUSTLLM_SHUTDOWN_TIMEOUT")] = 5.0,
    engine_flags: dict | None = None,
    config_file: o.ConfigFile = None,
) -> None:
    """Serve a model over the OpenAI API, with Anthropic's, Ollama's and llama-server's
    routes, /health and /metrics. Several MODELs, --models or --models-dir: router mode, one
    endpoint for many models, each in its own process."""
    with cli_errors(), Interrupts() as interrupts:
        import uvicorn

        o.check_serve_values(port=port, shutdown_timeout=shutdown_timeout, role=role,
                             served_model_name=served_model_name, models=models,
                             models_file=models_file, models_dir=models_dir, host=host,
                             api_key=api_key)
        if models_file or models_dir or len(models or []) > 1:
            if record_text:  # the runners (our children) record text too
                os.environ["JUSTLLM_RECORD_TEXT"] = "1"
            return _serve_gateway(models or [], models_file, models_dir, host, port, api_key,
                                  shutdown_timeout, engine_flags or {}, plugins_of(context),
                                  interrupts, o.typed_flags(context))
        model = models[0] if models else None
        _watch_parent()

        from justllm.engine.async_engine import AsyncEngine
        from justllm.engine.backend import require_gpu_offload
        from justllm.engine.engine import Engine
        from justllm.models.gguf import read_gguf_header
        from justllm.models.registry import lease_for_path
        from justllm.server.config import KEEP_ALIVE_SECONDS, ServerConfig, served_model_id
        from justllm.server.loading import EarlyLoad

        flags = engine_flags or {}
        plugins = plugins_of(context)
        config = o.engine_config(model, flags, plugins, o.typed_flags(context))
        model_path = config.model or ""  # engine_config resolved it to a file's path
        routes, events = plugins.route_list(), plugins.request_events()
        warn_problems(plugins)
        # Fail fast, before binding the port, on what can be checked without loading.
        read_gguf_header(model_path)  # not a GGUF, or truncated
        if config.gpu:
            require_gpu_offload()
        server_config = ServerConfig(host=host, port=port, api_key=api_key,
                                     model_name=served_model_name or plugins.served_name(model),
                                     role=role,
                                     record_text=record_text,
                                     # (a runner: its gateway started it, and alone holds
                                     # its key; see ServerConfig)
                                     gateway_headers=api_key is not None and bool(
                                         os.environ.get("JUSTLLM_PARENT_PID")))
        model_id = served_model_id(model_path, server_config.model_name)
        if any(a.name == model_id for a in config.lora):
            # Clients choose an adapter by naming it as their model: the base model would be
            # out of reach (/v1/load_lora_adapter refuses the name the same way).
            raise ValueError(f"--lora {model_id}=…: '{model_id}' is the base model's name; "
                             "give the adapter another")
        sock = listening_socket(host, port)
        Console(stderr=True, emoji=False).print(
            f"justllm: serving [bold]{escape(str(config.model))}[/bold] on http://{host}:{port} "
            f"(OpenAI API at /v1, /health, /metrics, docs at /docs)", highlight=False,
            soft_wrap=True)  # one line in a log: a path or URL cut in two is not grep's
        if not config.verbose:
            logging.getLogger("justllm").setLevel(logging.WARNING)
        # A lease on the model's registered version, from before its load begins:
        # `justllm rm` refuses it while we load and serve. The load starts now, while the web
        # framework is imported and the app built (the demo model ready 0.45 s sooner on a
        # 2-core AMD EPYC); the app takes it over as it starts. Whatever ends serve before
        # that (Ctrl-C, an error) cancels the load and waits for it.
        with lease_for_path(model_path):
            early = EarlyLoad(lambda cancelled: AsyncEngine(
                                  Engine(config, model_checked=True, cancel=cancelled)),
                              close=AsyncEngine.close).start()
            try:
                from justllm.server.app import begin_shutdown, create_app
                from justllm.server.http_limits import LimitedHttpProtocol

                app = create_app(None, server_config, loader=early.take,
                                 routes=routes.handlers, events=events,
                                 route_owners=routes.owners)
                # uvicorn's own limit is a backstop: by then begin_shutdown has ended every
                # request.
                server = _Server(uvicorn.Config(app, host=host, port=port,
                                                http=LimitedHttpProtocol,
                                                log_level="info" if config.verbose else "warning",
                                                timeout_keep_alive=KEEP_ALIVE_SECONDS,
                                                timeout_graceful_shutdown=math.ceil(
                                                    shutdown_timeout) + 5),
                                 on_exit=lambda: begin_shutdown(app, shutdown_timeout),
                                 on_force=lambda: begin_shutdown(app, 0.0),
                                 interrupts=interrupts)
                app.state["stop_server"] = lambda: setattr(server, "should_exit", True)
                server.run(sockets=[sock])
            finally:
                early.stop()
        if app.state.get("load_error"):
            raise ModelLoadError(app.state["load_error"])
        if server.forced:
            raise typer.Exit(130)


def _watch_parent() -> None:
    """A runner started by a gateway (JUSTLLM_PARENT_PID) stops when the gateway is gone, even
    if it was SIGKILLed and could not stop its runners."""
    import time

    parent = os.environ.get("JUSTLLM_PARENT_PID")
    if not parent or not parent.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="justllm-parent-watch", daemon=True).start()


def _serve_gateway(models: list[str], models_file: str | None, models_dir: str | None,
                   host: str, port: int, api_key: str | None, shutdown_timeout: float,
                   flags: dict, plugins: Plugins, interrupts: Interrupts,
                   typed: frozenset[str]) -> None:
    import asyncio

    import uvicorn

    from justllm.gateway.app import (
        GatewaySettings,
        all_runners_stopped,
        create_gateway,
        default_log_dir,
    )
    from justllm.server.http_limits import LimitedHttpProtocol

    # (serve checked the port, the shutdown timeout and the mode: options.check_serve_values)
    routes = plugins.routes()
    config = gateway_config(models, models_file, models_dir, flags, plugins, typed)
    try:  # (it was made at the first runner's start: each load failed, three times)
        default_log_dir().mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot make the runner log folder {default_log_dir()}: "
                         f"{e.strerror or e}") from None
    warn_problems(plugins)  # a model source that failed while the models were resolved
    app = create_gateway(config, GatewaySettings(host, port, api_key,
                                                 shutdown_timeout=shutdown_timeout),
                         default_log_dir(), routes)
    names = ", ".join(m.name for m in config.models)
    sock = listening_socket(host, port)
    Console(stderr=True, emoji=False).print(f"justllm: router mode on http://{host}:{port} for {names} "
                               f"(runner logs in {default_log_dir()})", highlight=False,
                               soft_wrap=True)

    def stop_runners() -> None:  # on the first signal: runners drain while clients finish
        sup = app.state.get("supervisor")
        if sup is not None:
            asyncio.get_event_loop().call_soon_threadsafe(
                lambda: asyncio.ensure_future(sup.close()))

    # Runners drain for shutdown_timeout; uvicorn's own limit is a backstop beyond it.
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                    http=LimitedHttpProtocol,
                                    timeout_graceful_shutdown=math.ceil(shutdown_timeout) + 10),
                     on_exit=stop_runners, on_force=lambda: all_runners_stopped(app, wait=False),
                     interrupts=interrupts)
    try:
        server.run(sockets=[sock])
    finally:
        all_runners_stopped(app)
    if server.forced:
        raise typer.Exit(130)


def gateway_config(models: list[str], models_file: str | None, models_dir: str | None,
                   flags: dict, plugins: Plugins,
                   typed: frozenset[str] = frozenset()) -> GatewayConfig:
    """Router mode's models (several MODELs, ``--models FILE`` or ``--models-dir DIR``), read
    and checked as far as can be before a runner starts; ``justllm config show`` asks it too.
    ``flags``: the engine flags' values; ``typed``: those given on the command line."""
    from justllm.gateway.config import (
        Flags,
        check_sources,
        directory_config,
        list_config,
        read_config,
    )

    # Engine flags given on this command line reach every runner (a model's entry wins): one
    # typed at its default too (--gamma 4 is refused where --gamma 3 is).
    given = {f.name.replace("_", "-"): flags[f.name] for f in o.ENGINE_FLAGS
             if f.name in flags and (flags[f.name] != f.default or f.name in typed)}
    if given.get("lora"):  # an adapter of every model would be one name several times
        raise ValueError("--lora in router mode: an adapter belongs to one model; give it in "
                         "that model's models.yaml entry (lora: [NAME=PATH[:SCALE]])")
    policies, sources = plugins.routing_policies, plugins.model_sources()
    warn_problems(plugins)  # a policy, source or route a plugin failed to register
    known = Flags(o.YAML_FLAGS, given, switches=o.YAML_SWITCHES,
                  routing_policies=policies, model_sources=sources,
                  spec_methods=plugins.spec_methods)
    config = (read_config(models_file, known) if models_file
              else directory_config(models_dir, known) if models_dir
              else list_config(models, known, plugins.served_name))
    check_sources(config)
    _check_runner_flags(config, plugins)
    return config


def check_entry_flags(models: Sequence[ModelSpec], plugins: Plugins) -> None:
    """Each model's engine flags as its runner (or a cluster's replica) takes them: typed on
    its command line, so one that would do nothing is refused whatever its value (``gamma:
    4``, the default, without ``spec``): options.fit_engine_values."""
    for m in models:
        values = {key.replace("-", "_"): value for key, value in m.flags}
        try:
            o.fit_engine_values(o.config_values(values), values.keys(), plugins.spec_methods)
        except ValueError as e:
            raise ValueError(f"model '{m.name}': {e}") from None


def _check_runner_flags(config: GatewayConfig, plugins: Plugins) -> None:
    """What a model's runners would refuse as they start, asked now as a single model's serve
    asks it (each model failed at its first request, after three runner starts):
    check_local_engines. Only the models with local replicas: urls run elsewhere."""
    check_local_engines([m for m in config.models if m.replicas], plugins)


def check_local_engines(local: Sequence[ModelSpec], plugins: Plugins) -> None:
    """What an engine of each model, started on this machine, would refuse as it starts:
    ``gpu`` on a CPU-only build, a ``chat-template`` that names no built-in template and no
    Jinja file, a ``pool-blocks`` whose KV cannot fit in this machine's memory (of a model
    that is a file here; the others are resolved as they start), a flag that would do
    nothing, such as ``gamma`` without ``spec`` (a runner gets its flags on its command line,
    where it refuses them whatever their value: options.fit_engine_values). Router mode's
    runners, and a Ray cluster's replicas when the cluster is this machine alone. (The engine
    is imported only where it is asked: the gateway itself loads no llama.cpp.)"""
    from justllm.gateway.config import gguf_path, runner_engine_config

    check_entry_flags(local, plugins)
    for m in local:
        flags = dict(m.flags)
        draft = flags.get("draft-model")
        model, draft_path = gguf_path(m.source), gguf_path(draft) if draft else None
        if flags.get("pool-blocks") and model is not None and model.is_file() and (
                not draft or (draft_path is not None and draft_path.is_file())):
            engine = runner_engine_config(m, plugins.spec_methods)
            try:
                o.check_pool_fits(dataclasses.replace(
                    engine, model=str(model),
                    draft_model=str(draft_path) if draft_path else None))
            except ModelLoadError:
                pass  # a broken file fails its own model at its first request, not the others
            except ValueError as e:
                raise ValueError(f"model '{m.name}': {e}") from None
    if any(dict(m.flags).get("gpu") for m in local):
        from justllm.engine.backend import require_gpu_offload

        require_gpu_offload()
    for m in local:
        template = dict(m.flags).get("chat-template")
        if template is not None:  # (a non-empty string: models.yaml's checks saw to it)
            from justllm.engine.chat_template import ChatTemplate

            try:
                ChatTemplate.named(template)
            except ValueError as e:
                raise ValueError(f"model '{m.name}': {e}") from None


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound as uvicorn binds one (IPv6 when the host has a colon), but
    before anything says it serves: a port in use or a host that is not this machine's is one
    error line, not a banner and then uvicorn's log line and exit code 3."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as e:
        sock.close()
        raise ValueError(f"--host {host}: {e.strerror}") from None
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {(e.strerror or str(e)).lower()}") from None
    sock.set_inheritable(True)
    return sock


def _make_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM after a graceful shutdown, which turns a clean stop
        into a traceback or a non-zero exit; here a signal only asks the server to stop, and
        the first one also starts the drain (``on_exit``). A second one ends the drain now
        (``on_force``: every request ended as a shutdown ends it, without uvicorn's forced
        exit, which cancelled streams mid-token and printed tracebacks) and the command
        exits 130 (``forced``); a third is uvicorn's forced exit."""

        def __init__(self, config, on_exit=None, on_force=None, interrupts=None) -> None:
            super().__init__(config)
            self._on_exit = on_exit
            self._on_force = on_force
            self._interrupts = interrupts
            self._timer = None
            self.forced = False

        def handle_exit(self, sig, frame) -> None:  # type: ignore[override]
            if self.should_exit and not self.forced and self._on_force is not None:
                self.forced = True
                self._on_force()
                return
            if not self.should_exit and self._on_exit is not None:
                self._timer = self._on_exit()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            previous = {sig: signal.signal(sig, self.handle_exit)
                        for sig in (signal.SIGINT, signal.SIGTERM)}
            if self._interrupts is not None and self._interrupts.came:
                self.handle_exit(signal.SIGINT, None)  # one Python dropped (Interrupts)
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                if self._timer is not None:
                    self._timer.cancel()

    return Server


def _Server(config, on_exit=None, on_force=None, interrupts=None):  # noqa: N802  (a class factory: uvicorn is imported lazily)
    return _make_server_class()(config, on_exit, on_force, interrupts)


class Interrupts(SigintHandler):
    """Ctrl-C while ``justllm serve`` starts, before the server's own signal handlers are in.
    Python raises KeyboardInterrupt at the next bytecode it runs, and where that is a weakref
    callback, a ``__del__`` or a C callback, it prints "Exception ignored" and drops it: the
    server then started and served on (2 of 31 Ctrl-Cs 1.0-1.8 s into a start). Here a Ctrl-C
    still raises (a model download or an import stops as before) and is also remembered
    (``came``); the server stops at once for a remembered one as its handlers go in. Only
    where SIGINT has Python's own handler: a background job's ignored SIGINT stays ignored,
    and a thread other than the main one changes nothing."""

    def __init__(self) -> None:
        self.came = False

    def _handle(self, signum: int, frame: object) -> None:
        self.came = True
        raise KeyboardInterrupt
