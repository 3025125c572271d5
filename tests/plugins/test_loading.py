"""Loading plugins: entry points, JUSTLLM_PLUGINS, a plugin that fails, hook order, duplicate
names, and on_request_finished's isolation of a plugin that raises or blocks."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from justllm.core.record import RequestRecord
from justllm.plugins import Plugins, hookimpl, load_plugins
from justllm.plugins.events import RequestEvents

SITE = Path(__file__).parent / "site"  # justllm-sample and justllm-broken, as pip installs them


def justllm(*args: str, plugins: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JUSTLLM_PLUGINS"}
    env["PYTHONPATH"] = str(SITE)
    if plugins is not None:
        env["JUSTLLM_PLUGINS"] = plugins
    return subprocess.run([sys.executable, "-m", "justllm", *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def site(monkeypatch):
    monkeypatch.syspath_prepend(str(SITE))
    yield
    sys.modules.pop("justllm_sample", None)


def names(r: subprocess.CompletedProcess) -> set[str]:
    assert r.returncode == 0, r.stderr
    return {p["name"] for p in json.loads(r.stdout)}


# ---- discovery through entry points ------------------------------------------------------------

def test_an_installed_plugin_is_listed_with_its_version_and_hooks_and_a_broken_one_is_one_line():
    r = justllm("plugins", "--json", plugins=None)
    assert r.returncode == 0
    sample = next(p for p in json.loads(r.stdout) if p["name"] == "justllm-sample")
    assert sample["version"] == "0.3"
    assert sample["hooks"] == sorted(["on_request_finished", "register_commands",
                                      "register_model_sources", "register_routes",
                                      "register_routing_policies", "register_spec_methods"])
    assert "justllm-broken" not in names(r)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines == ["warning: plugin justllm-broken failed to load: ImportError: "
                     "justllm_broken needs a library that is not installed"]


def test_justllm_plugins_chooses_which_are_loaded():
    assert names(justllm("plugins", "--json", plugins="justllm-sample")) == {"justllm-sample"}
    assert names(justllm("plugins", "--json", plugins="sample")) == {"justllm-sample"}  # EP name
    # as pip compares names (each was "not installed")
    assert names(justllm("plugins", "--json", plugins="Justllm_Sample")) == {"justllm-sample"}
    empty = justllm("plugins", "--json", plugins="")
    assert names(empty) == set() and empty.stderr == ""  # none: not even the broken one tried
    r = justllm("plugins", "--json", plugins="justllm-sample, nope")
    assert names(r) == {"justllm-sample"}
    assert "JUSTLLM_PLUGINS names nope, which is not installed" in r.stderr
    # blanks around a name (after a comma): it was "not installed" and left out
    r = justllm("plugins", "--json", plugins="nope,  justllm-sample ")
    assert names(r) == {"justllm-sample"} and "justllm-sample" not in r.stderr, r.stderr
    builtin = justllm("plugins", "--json", "--all", plugins="")
    assert names(builtin) == {"justllm"}
    # one line in a pipe (rich cut it at 80 columns)
    none = justllm("plugins", plugins="")
    assert none.returncode == 0 and none.stdout == (
        "no plugins loaded (JUSTLLM_PLUGINS chooses them; see plugins/README.md to write "
        "one)\n"), none.stdout


def test_a_plugin_command_runs_and_is_gone_without_the_plugin():
    r = justllm("sample-hello", "--name", "you", plugins="justllm-sample")
    assert (r.returncode, r.stdout) == (0, "hello you\n")
    r = justllm("sample-hello", plugins="")
    assert r.returncode != 0 and "No such command 'sample-hello'" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_plugin_models_reference_without_the_plugin_names_the_plugin():
    """``ollama:NAME`` with justllm-ollama left out said only "model not found", and offered
    a path, a registry name or a Hugging Face repo."""
    r = justllm("show", "ollama:gemma3", plugins="")
    assert r.returncode == 1 and r.stderr.strip() == (
        "error: model not found: ollama:gemma3 (ollama:NAME is read by the justllm-ollama "
        "plugin, which is not loaded: see 'justllm plugins')"), r.stderr
    r = justllm("show", "nothing-here:v2", plugins="")  # (a registry tag: the usual words)
    assert r.returncode == 1 and "(see 'justllm models')" in r.stderr, r.stderr


def test_a_plugin_cannot_replace_the_root_options():
    """A plugin's cli.callback() replaced justllm's: --version was "No such option"."""
    import typer

    from justllm.cli import build_app

    class Hijack:
        @hookimpl
        def register_commands(self, cli):
            @cli.callback()
            def main() -> None:
                pass

            @cli.command("hijack-hello")
            def hello() -> None:
                print("hello")

    plugins = load_plugins({"JUSTLLM_PLUGINS": ""})
    plugins.register(Hijack(), "hijack")
    cli = build_app(plugins)
    r = CliRunner().invoke(cli, ["--version"])
    assert r.exit_code == 0 and "justllm" in r.output, r.output
    assert CliRunner().invoke(cli, ["hijack-hello"]).output == "hello\n"
    assert plugins.problems == ["plugin hijack: it replaced justllm's own options "
                                "(cli.callback); left out"]
    assert isinstance(cli, typer.Typer)


def test_a_plugin_model_source_is_listed_and_resolved(site):
    plugins = load_plugins({"JUSTLLM_PLUGINS": "justllm-sample"})
    from justllm.models.source import demo_model_path

    assert plugins.resolve_model("sample:demo") == str(demo_model_path())
    assert plugins.served_name("sample:demo") == "demo"
    assert plugins.served_name(str(demo_model_path())) is None
    from justllm.cli import build_app

    r = CliRunner().invoke(build_app(plugins), ["models"], obj=plugins)
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if line.startswith("sample:demo"))
    assert row.split()[1:] == ["-", "253.1", "MB", "Q4_K_M", "gemma3", "32768"]
    r = CliRunner().invoke(build_app(plugins), ["run", "sample:nothing", "-p", "hi"],
                           obj=plugins)
    assert r.exit_code == 1 and "model not found: sample:nothing" in r.output


# ---- registries: order, priorities, duplicates, failures ----------------------------------------

class Source:
    def __init__(self, name: str, knows: str, path: str) -> None:
        self.name, self.knows, self.path = name, knows, path

    def find(self, ref: str):
        return Path(self.path) if ref == self.knows else None


def test_sources_go_by_priority_then_registration_among_the_built_in_ones(tmp_path):
    real = tmp_path / "real.gguf"
    real.write_bytes(b"GGUF")

    class A:
        @hookimpl
        def register_model_sources(self, register):
            register(Source("late", str(real), "/late/says"), priority=450)
            register(Source("early", "x", "/early/says"), priority=50)

    class B:
        @hookimpl
        def register_model_sources(self, register):
            register(Source("same", "x", "/same/says"), priority=50)

    plugins = load_plugins({"JUSTLLM_PLUGINS": ""})
    plugins.register(A(), "a")
    plugins.register(B(), "b")
    order = [s.name for s in plugins.model_sources()]
    assert order == ["early", "same", "path", "registry", "models directory", "Hugging Face",
                     "late", "demo"]
    assert plugins.resolve_model("x") == "/early/says"  # 50 before 50 registered later
    assert plugins.resolve_model(str(real)) == str(real)  # the path (100) before 450


def test_a_plugin_cannot_take_a_built_in_name_and_a_failing_hook_is_skipped():
    from justllm.spec.methods import SPEC_METHODS, SpecMethod

    class Greedy:
        @hookimpl
        def register_spec_methods(self, register):
            register(SpecMethod("ngram", draft_model=True))  # taken by the built-in plugin
            register(SpecMethod("mine", draft_model=True))

        @hookimpl
        def register_routing_policies(self, register):
            raise RuntimeError("no policies today")

    class Bad:
        @hookimpl
        def register_spec_methods(self, register):
            register("not a SpecMethod")

    plugins = load_plugins({"JUSTLLM_PLUGINS": ""})
    plugins.register(Greedy(), "greedy")
    plugins.register(Bad(), "bad")
    methods = plugins.spec_methods
    assert methods["ngram"] is SPEC_METHODS["ngram"]
    assert list(methods) == ["ngram", "draft", "tree", "mine"]
    assert set(plugins.routing_policies) == {"round-robin", "least-load", "power-of-two",
                                             "cache-aware"}
    assert plugins.problems == [
        "plugin greedy: spec method 'ngram' is registered already (by justllm); ignored",
        "plugin bad: register_spec_methods failed: TypeError: register_spec_methods takes "
        "SpecMethod(...) entries",
        "plugin greedy: register_routing_policies failed: RuntimeError: no policies today"]


def test_a_hook_wrapper_is_left_out_and_said():
    """justllm calls each implementation itself: a wrapper's body (a generator) never ran,
    and nothing said so."""
    class Wraps:
        @hookimpl(hookwrapper=True)
        def register_routing_policies(self, register):
            yield

        @hookimpl(wrapper=True)
        def on_request_finished(self, record):
            return (yield)

    plugins = load_plugins({"JUSTLLM_PLUGINS": ""})
    plugins.register(Wraps(), "wraps")
    assert set(plugins.routing_policies) == {"round-robin", "least-load", "power-of-two",
                                             "cache-aware"}
    assert plugins.request_events() is None
    assert plugins.problems == [
        "plugin wraps: its register_routing_policies is a hook wrapper, which justllm does "
        "not run: left out",
        "plugin wraps: its on_request_finished is a hook wrapper, which justllm does not run: "
        "left out"]


def test_a_hookimpl_for_no_hook_is_refused():
    class Typo:
        @hookimpl
        def on_request_finishd(self, record):
            pass

    plugins = load_plugins({"JUSTLLM_PLUGINS": ""})
    with pytest.raises(Exception, match="unknown hook 'on_request_finishd'"):
        plugins.register(Typo(), "typo")
    assert plugins.pm.get_plugin("typo") is None


def test_a_plugin_routing_policy_is_what_models_yaml_names(site):
    from justllm.gateway.config import Flags, load_config
    from justllm.gateway.routing import ReplicaLoad, RouteRequest, make_router

    plugins = load_plugins({"JUSTLLM_PLUGINS": "justllm-sample"})
    flags = Flags(frozenset(), routing_policies=plugins.routing_policies)
    data = {"models": {"m": {"urls": ["http://a:1", "http://b:2"], "routing": "last"}}}
    spec = load_config(data, flags).models[0]
    router = make_router(spec.routing)
    loads = [ReplicaLoad("a"), ReplicaLoad("b", running=9)]  # least-load would say a
    assert router.choose(RouteRequest(text="hi"), loads).replica == "b"
    assert router.counts == {"last": 1}
    with pytest.raises(ValueError, match="must be one of .*cache-aware, last"):
        load_config({"models": {"m": {"urls": ["http://a:1"], "routing": "first"}}}, flags)
    with pytest.raises(ValueError, match="must be one of"):  # without the plugin
        load_config(data, Flags(frozenset()))


# ---- on_request_finished: delivery, failures, a plugin that blocks ------------------------------

def record(i: int) -> RequestRecord:
    return RequestRecord(request_id=f"r{i}", model="m", finish_reason="stop", prompt_tokens=3,
                         completion_tokens=2, cached_tokens=0, arrived_at=time.time(),
                         queued_seconds=0.0, prefill_seconds=0.1, decode_seconds=0.1,
                         total_seconds=0.2)


def test_every_plugin_gets_every_record_off_the_callers_thread_in_order():
    got: dict[str, list[str]] = {"a": [], "b": []}
    threads: set[str] = set()

    def sink(name):
        def fn(record):
            threads.add(threading.current_thread().name)
            got[name].append(record.request_id)
        return fn

    events = RequestEvents([("a", sink("a")), ("b", sink("b"))])
    for i in range(50):
        events(record(i))
    events.close()
    want = [f"r{i}" for i in range(50)]
    assert got == {"a": want, "b": want}
    assert threads == {"justllm-plugin-a", "justllm-plugin-b"}
    assert {k: (c.delivered, c.failed, c.dropped) for k, c in events.counts().items()} == {
        "a": (50, 0, 0), "b": (50, 0, 0)}


def test_a_plugin_that_changes_a_records_params_changes_them_for_itself_alone():
    """Every plugin was handed the same record: one that changed its params changed what the
    next one stored (request-log kept another plugin's values)."""
    seen: list[dict] = []

    def meddles(record):
        record.params.clear()
        record.params["temperature"] = 99.0

    def keeps(record):
        seen.append(dict(record.params))

    events = RequestEvents([("meddles", meddles), ("keeps", keeps)])
    given = replace(record(0), params={"max_tokens": 2, "temperature": 0.0})
    for _ in range(20):
        events(given)
    events.close()
    assert seen == [{"max_tokens": 2, "temperature": 0.0}] * 20
    assert given.params == {"max_tokens": 2, "temperature": 0.0}


def test_a_plugin_that_raises_or_blocks_harms_no_other():
    release = threading.Event()
    fine: list[str] = []

    def raises(record):
        if record.request_id.endswith(("1", "3")):
            raise ValueError("bad record")
        if record.request_id == "r5":  # (a BaseException ended the thread: all dropped)
            raise asyncio.CancelledError()

    def blocks(record):
        release.wait(10)

    events = RequestEvents([("raises", raises), ("blocks", blocks),
                            ("fine", lambda record: fine.append(record.request_id))],
                           max_pending=5)
    counts = events.counts()
    for i in range(20):
        start = time.monotonic()
        events(record(i))  # never waits for the blocked plugin
        assert time.monotonic() - start < 1
        while (counts["fine"].delivered, counts["raises"].delivered + counts["raises"].failed
               ) != (i + 1, i + 1):  # the others keep up (one record at a time here)
            assert time.monotonic() - start < 10
            time.sleep(0.001)
    release.set()
    events.close()
    counts = {k: (c.delivered, c.failed, c.dropped) for k, c in events.counts().items()}
    assert counts["raises"] == (15, 5, 0)  # r1, r3, r5, r11, r13
    assert counts["fine"] == (20, 0, 0) and fine == [f"r{i}" for i in range(20)]
    delivered, failed, dropped = counts["blocks"]
    assert failed == 0 and dropped >= 20 - 5 - 1 and delivered + dropped == 20


def test_no_plugin_no_dispatcher():
    assert load_plugins({"JUSTLLM_PLUGINS": ""}).request_events() is None
    assert isinstance(Plugins().request_events(), type(None))
