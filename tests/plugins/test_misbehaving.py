"""Plugins that misbehave harm nobody else: a built-in name they try to take (a command, a spec
method or a policy, ``trylast`` or not), a route they cannot add, a model source, routing
policy or proposer that raises or answers nonsense, ``sys.exit()`` in their import or in a hook.
Each is skipped with one line, and the rest of justllm (other plugins included) goes on."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from litestar import get, post
from litestar.testing import TestClient
from typer.testing import CliRunner

from justllm.core.plan import DraftTree
from justllm.core.sampling_params import SamplingParams
from justllm.errors import InvalidRequestError
from justllm.gateway.routing import Decision, Policy, ReplicaLoad, RouteRequest
from justllm.plugins import hookimpl, load_plugins
from justllm.plugins.events import RequestEvents
from justllm.spec.controller import SpecController
from justllm.spec.methods import SPEC_METHODS, SpecMethod
from justllm.spec.proposer import DraftRequest


def fresh():
    return load_plugins({"JUSTLLM_PLUGINS": ""})


def test_trylast_takes_no_built_in_name():
    """pluggy lists trylast implementations first: read in that order, a plugin took `ngram`
    and `round-robin` and the warning blamed justllm's own."""
    class Late:
        @hookimpl(trylast=True)
        def register_spec_methods(self, register):
            register(SpecMethod("ngram", proposer=lambda: None))

        @hookimpl(tryfirst=True)
        def register_routing_policies(self, register):
            register("round-robin", Policy)

    plugins = fresh()
    plugins.register(Late(), "late")
    assert plugins.spec_methods["ngram"] is SPEC_METHODS["ngram"]
    assert plugins.routing_policies["round-robin"] is not Policy
    assert plugins.problems == [
        "plugin late: spec method 'ngram' is registered already (by justllm); ignored",
        "plugin late: routing policy 'round-robin' is registered already (by justllm); ignored"]


def test_an_implementation_may_leave_out_its_arguments():
    seen: list[str] = []

    class Quiet:
        @hookimpl
        def register_routes(self):
            seen.append("routes")

        @hookimpl
        def on_request_finished(self):
            seen.append("record")

    plugins = fresh()
    plugins.register(Quiet(), "quiet")
    assert plugins.routes() == []
    events = plugins.request_events()
    assert events is not None
    from tests.plugins.test_loading import record
    events(record(1))
    events.close()
    assert seen == ["routes", "record"] and not plugins.problems
    assert events.counts()["quiet"].delivered == 1


def test_a_command_with_a_taken_name_is_left_out():
    from justllm.cli import build_app

    class Clash:
        @hookimpl
        def register_commands(self, cli):
            @cli.command("serve")
            def serve_clash() -> None:
                print("CLASH")

            @cli.command()
            def plugins() -> None:  # named by its function
                print("CLASH")

            @cli.command("hello")
            def hello() -> None:
                print("hello from a plugin")

    class Again:
        @hookimpl
        def register_commands(self, cli):
            @cli.command("hello")
            def hello_again() -> None:
                print("AGAIN")

    plugins = fresh()
    plugins.register(Clash(), "clash")
    plugins.register(Again(), "again")
    app = build_app(plugins)
    runner = CliRunner()
    assert "CLASH" not in runner.invoke(app, ["plugins"], obj=plugins).output
    assert "Serve a model over the OpenAI API" in runner.invoke(
        app, ["serve", "--help"], obj=plugins).output
    assert runner.invoke(app, ["hello"], obj=plugins).output == "hello from a plugin\n"
    assert plugins.problems == [
        "plugin clash: the command 'serve' exists already; left out",
        "plugin clash: the command 'plugins' exists already; left out",
        "plugin again: the command 'hello' exists already; left out"]


class Raising:
    name = "raising"

    def find(self, ref):
        raise RuntimeError("find blew up")

    def served_name(self, ref):
        raise RuntimeError("served_name blew up")


class Number:
    name = "number"

    def find(self, ref):
        return 42


def test_a_failing_model_source_is_skipped_with_one_line(model_path):
    class Sources:
        @hookimpl
        def register_model_sources(self, register):
            register(Raising(), priority=10)
            register(Number(), priority=20)

    plugins = fresh()
    plugins.register(Sources(), "sources")
    assert plugins.resolve_model(model_path) == model_path  # the path source still answers
    assert plugins.resolve_model(model_path) == model_path  # ... and the line comes once
    assert plugins.served_name(model_path) is None
    assert plugins.plugin_model("anything") is None
    assert plugins.problems == [
        "plugin sources: model source raising: find failed: RuntimeError: find blew up; "
        "skipped",
        "plugin sources: model source number: find gave a int, not a path; skipped"]


def test_load_and_hooks_survive_sys_exit_and_every_entry_point_loads(tmp_path):
    """A plugin calling sys.exit() at import ended every justllm command silently; a second
    entry point of one distribution was ignored."""
    site = tmp_path / "site"
    write_dist(site, "justllm-exits", "exits = justllm_exits",
               {"justllm_exits.py": "import sys\nsys.exit(3)\n"})
    write_dist(site, "justllm-two", "one = justllm_two_a\ntwo = justllm_two_b", {
        "justllm_two_a.py": COMMAND.format(name="two-a"),
        "justllm_two_b.py": COMMAND.format(name="two-b")})
    env = {k: v for k, v in os.environ.items() if k != "JUSTLLM_PLUGINS"}
    env["PYTHONPATH"] = str(site)

    def justllm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "justllm", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    for name in ("two-a", "two-b"):
        r = justllm(name)
        assert r.returncode == 0 and r.stdout == f"{name} ran\n", r.stdout + r.stderr
        assert "warning: plugin justllm-exits failed to load: SystemExit: 3" in r.stderr
    listed = justllm("plugins")
    assert "justllm-two " in listed.stdout and "justllm-two:two " in listed.stdout


COMMAND = textwrap.dedent("""\
    from justllm.plugins import hookimpl

    @hookimpl
    def register_commands(cli):
        @cli.command("{name}")
        def run():
            print("{name} ran")
    """)


def write_dist(site: Path, dist: str, entry_points: str, files: dict[str, str]) -> None:
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[justllm]\n{entry_points}\n")
    for name, text in files.items():
        (site / name).write_text(text)


def test_registration_problems_are_printed_in_router_mode(tmp_path):
    site = tmp_path / "site"
    write_dist(site, "justllm-nopolicy", "nopolicy = justllm_nopolicy", {
        "justllm_nopolicy.py": "from justllm.plugins import hookimpl\n\n@hookimpl\n"
                               "def register_routing_policies(register):\n"
                               "    raise RuntimeError('no policies today')\n"})
    (tmp_path / "models.yaml").write_text(f"models:\n  a: {tmp_path / 'missing.gguf'}\n")
    env = {k: v for k, v in os.environ.items() if k != "JUSTLLM_PLUGINS"}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-m", "justllm", "serve", "--models",
                        str(tmp_path / "models.yaml"), "--port", "1"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert ("warning: plugin justllm-nopolicy: register_routing_policies failed: "
            "RuntimeError: no policies today") in r.stderr, r.stderr


def test_a_route_that_cannot_be_added_leaves_the_others(caplog):
    from justllm.server.app import ServerConfig, create_app

    @post("/v1/chat/completions")
    async def clash() -> str:
        return "clash"

    @get("/v1/ping")
    async def ping() -> str:
        return "pong"

    class Bad:
        @hookimpl
        def register_routes(self, app_builder):
            app_builder.add(clash)
            app_builder.add(lambda: None)  # not a route handler

    class Good:
        @hookimpl
        def register_routes(self, app_builder):
            app_builder.add(ping)

    plugins = fresh()
    plugins.register(Bad(), "bad")
    plugins.register(Good(), "good")
    routes = plugins.route_list()
    assert plugins.problems == ["plugin bad: register_routes failed: TypeError: "
                                "app_builder.add takes a Litestar route handler "
                                "(@litestar.get/post/...), not function"]
    with caplog.at_level(logging.WARNING, logger="justllm.server.app"):
        app = create_app(None, ServerConfig(), routes=routes.handlers,
                         route_owners=routes.owners)
    with TestClient(app) as client:
        assert client.get("/v1/ping").text == "pong"
        r = client.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 503 and "loading" in r.text  # justllm's own route
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("plugin bad: the route /v1/chat/completions is left out: Handler "
                              "already registered for path '/v1/chat/completions'"), warning


class Broken(Policy):
    def __init__(self, answer, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.answer = answer

    def pick(self, request, available, replicas):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer", [RuntimeError("pick blew up"), Decision("gone", "load"),
                                    "a"])
def test_a_failing_policy_routes_to_the_least_loaded_replica(answer, caplog):
    loads = [ReplicaLoad("a", running=3), ReplicaLoad("b", running=1),
             ReplicaLoad("c", healthy=False)]
    policy = Broken(answer)
    with caplog.at_level(logging.WARNING, logger="justllm.gateway.routing"):
        picks = [policy.choose(RouteRequest(text="hi"), loads) for _ in range(3)]
    assert picks == [Decision("b", "policy-failed")] * 3
    assert policy.counts == {"policy-failed": 3} and policy.failures == 3
    assert len(caplog.records) == 1 and "Broken failed (1 so far)" in caplog.text


class Proposer:
    costly = False

    def __init__(self, answer):
        self.answer = answer

    def propose(self, wants):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def release(self, request_id):
        raise RuntimeError("release blew up")

    def close(self):
        pass


def wants(*ids: str) -> list[DraftRequest]:
    return [DraftRequest(i, [1, 2, 3], 4, SamplingParams()) for i in ids]


@pytest.mark.parametrize("answer, kept", [
    (RuntimeError("propose blew up"), {}),
    ([DraftTree.chain([5])], {}),  # not a dict
    ({"r1": DraftTree.chain([5, 6]), "r2": DraftTree.chain([10 ** 9]),  # out of the vocab
      "r3": DraftTree.chain([5]),  # nobody asked
      "r4": [5, 6],  # not a DraftTree
      "r5": DraftTree((5, 6), (-1, 1)),  # its own parent
      "r6": DraftTree.chain(list(range(50)))}, {"r1"}),  # deeper than r6 may go
    # probability rows a verification cannot use (an IndexError, or a token past the
    # vocabulary drawn from NaNs: both failed every request of the step)
    ({"r1": DraftTree.chain([5, 6], q=np.full((2, 1000), 1e-3)),
      "r2": DraftTree.chain([5, 6], q=np.full((2, 3), 0.3)),  # narrower than the vocabulary
      "r4": DraftTree.chain([5, 6], q=np.full((2, 1000), np.nan)),
      "r5": DraftTree.chain([5, 6], q=[[0.5] * 1000]),  # one row for two nodes
      "r6": DraftTree.chain([5], q=[[-1.0] * 1000])}, {"r1"}),
])
def test_a_failing_proposer_costs_drafts_never_requests(answer, kept, caplog):
    spec = SpecController(Proposer(answer), gamma=4, max_nodes=8, p_min=0.0, n_vocab=1000)
    with caplog.at_level(logging.WARNING, logger="justllm.spec.controller"):
        got = spec.propose(wants("r1", "r2", "r4", "r5", "r6"))
        spec.release("r1")  # a raising release is logged (as the 2nd failure), not raised
    assert set(got) == set(kept) and spec.failures == 2
    assert len(caplog.records) == 1  # the first failure; the next at the 1000th


def test_a_request_may_ask_for_no_deeper_drafts_than_gamma():
    """On a tree server (max_nodes 14 for --gamma 4) n_max up to 14 was taken: the tree
    drafted that deep was then thrown away, every step, and the request backed off."""
    spec = SpecController(Proposer({}), gamma=4, max_nodes=14, p_min=0.0, n_vocab=1000)
    spec.check(SamplingParams(spec_n_max=4))
    with pytest.raises(InvalidRequestError, match=r"at most 4 draft tokens on this server "
                                                  r"\(its --gamma; got 5\)"):
        spec.check(SamplingParams(spec_n_max=5))


def test_an_engine_whose_plugin_proposer_raises_answers_as_without_it(model_path):
    from justllm.engine.llm import LLM
    from justllm.errors import ModelLoadError

    def run(method: SpecMethod | None) -> str:
        methods = {**SPEC_METHODS, **({method.name: method} if method else {})}
        with LLM(model_path, max_seqs=2, pool_blocks=64, spec=method.name if method else "",
                 spec_methods=methods) as llm:
            return llm.generate("The capital of France is",
                                SamplingParams(max_tokens=12, temperature=0))[0].text

    plain = run(None)
    assert run(SpecMethod("bad", proposer=lambda: Proposer(RuntimeError("no")))) == plain
    with pytest.raises(ModelLoadError, match="--spec worse: its proposer could not be made: "
                                             "ZeroDivisionError"):
        run(SpecMethod("worse", proposer=lambda: 1 / 0))


def test_sys_exit_in_on_request_finished_is_a_failure_not_a_dead_thread():
    from tests.plugins.test_loading import record

    def exits(record):
        if record.request_id == "r1":
            sys.exit(2)

    events = RequestEvents([("exits", exits)])
    for i in range(3):
        events(record(i))
    events.close()
    counts = events.counts()["exits"]
    assert (counts.delivered, counts.failed, counts.dropped) == (2, 1, 0)
