"""What a failed ``justllm cluster deploy`` says and leaves, with Ray's calls faked: a real
failed deploy needs a fresh Ray head of its own (a minute here); the deploy itself is tested
on a real cluster in test_ray_cluster.py."""

from __future__ import annotations

import contextlib
import re
from functools import partial
from types import SimpleNamespace

import pytest

from justllm.cluster import deploy as d
from justllm.cluster.local_ray import LocalHead
from justllm.cluster.options import ClusterSettings
from justllm.errors import JustLLMError

HEAD = LocalHead(pid=1, address="127.0.0.1:1", log="/nowhere")


@pytest.fixture
def ray_faked(monkeypatch):
    """``serve`` as a dict of apps; connecting, building and stopping the head recorded."""
    apps: dict[str, str] = {}
    done: list[str] = []
    monkeypatch.setattr(d, "connected", lambda cluster: contextlib.nullcontext())
    monkeypatch.setattr(d, "build_app", lambda *a, **k: "app")
    monkeypatch.setattr(d.local_ray, "stop_head", lambda head: done.append("head stopped"))
    monkeypatch.setattr(d.serve, "status", lambda: SimpleNamespace(applications={
        name: app_status(state) for name, state in apps.items()}))
    monkeypatch.setattr(d.serve, "delete", lambda name: apps.pop(name))
    monkeypatch.setattr(d.serve, "shutdown", apps.clear)
    monkeypatch.setattr(d, "serve_address", lambda: ("127.0.0.1", 8000))  # Ray Serve's default
    monkeypatch.setattr(d, "serve_running", lambda: True)
    monkeypatch.setattr(d, "cluster_nodes", lambda: [{"CPU": 2.0}])
    monkeypatch.setattr(d, "unplaceable", lambda config, nodes: [])
    return apps, done


def app_status(state, deployments=None):
    """An app's entry in ``serve.status().applications``, as Ray Serve's overview has it."""
    return SimpleNamespace(status=SimpleNamespace(value=state), message="",
                           deployments=deployments or {})


def test_a_port_in_use_is_one_error_line(ray_faked, monkeypatch):
    """It was an 80-line traceback."""
    def refuse(**kwargs):
        raise RuntimeError("Failed to bind to address '127.0.0.1:8000'.")

    monkeypatch.setattr(d.serve, "start", refuse)
    with pytest.raises(JustLLMError, match=r"cannot listen on 127.0.0.1:8000: .*Failed to bind"):
        d.deploy(None, ClusterSettings(), None, d.Cluster(HEAD.address, HEAD))
    assert ray_faked[1] == ["head stopped"]  # the head this deploy started: nothing on it


def test_a_port_something_else_holds_is_refused_before_serve_starts(ray_faked, monkeypatch):
    """Ray Serve's proxies bind with SO_REUSEPORT: a second cluster's Serve shared the port
    with the first, the kernel splitting the connections between them."""
    import socket

    monkeypatch.setattr(d, "serve_running", lambda: False)
    started: list[str] = []
    monkeypatch.setattr(d.serve, "start", lambda **kwargs: started.append("serve"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(JustLLMError) as e:
            d.deploy(None, ClusterSettings(port=port), None, d.Cluster(HEAD.address, HEAD))
    assert str(e.value) == (f"something already listens on 127.0.0.1:{port} (another Ray "
                            "cluster's Serve, or another server): Ray Serve would share the "
                            "port with it; pick another --port")
    assert started == [] and ray_faked[1] == ["head stopped"]


def test_no_head_is_started_for_a_port_something_else_holds(monkeypatch):
    """The port was checked once a head had started: a minute of starting and stopping it
    before the one line."""
    import socket

    started: list[str] = []
    monkeypatch.setattr(d, "find_cluster", lambda: None)
    monkeypatch.setattr(d, "start_local", lambda: started.append("head"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(JustLLMError, match=f"something already listens on 127.0.0.1:{port}"):
            d.find_or_start(lambda: started.append("said"), ClusterSettings(port=port))
    assert started == []


def test_a_replica_no_node_can_hold_is_refused_at_deploy_even_at_zero_replicas(
        ray_faked, monkeypatch):
    """A min-replicas 0 model whose replica fits on no node deployed "successfully", and each
    request for it then waited for a node without end."""
    from justllm.cluster.options import unplaceable
    from justllm.gateway.config import load_config
    from tests.cluster.test_options import FLAGS

    config = load_config({"models": {
        "small": {"source": "/m.gguf", "threads": 2},
        "az": {"source": "/m.gguf", "threads": 4, "min-replicas": 0, "max-replicas": 1},
        "gpu": {"source": "/m.gguf", "gpu": True}}}, FLAGS)
    nodes = [{"CPU": 3.0, "memory": 1e9}, {"CPU": 2.0, "GPU": 1.0}]
    assert unplaceable(config, nodes) == [("model-az", {"CPU": 4.0})]
    assert unplaceable(config, [{"CPU": 8.0}]) == [("model-gpu", {"CPU": 1.0, "GPU": 1.0})]
    monkeypatch.setattr(d, "unplaceable", unplaceable)
    monkeypatch.setattr(d, "cluster_nodes", lambda: nodes)
    ran: list[str] = []
    monkeypatch.setattr(d.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(d.serve, "_run", lambda *a, **k: ran.append("deployed"))
    with pytest.raises(JustLLMError) as e:
        d.deploy(config, ClusterSettings(), None, d.Cluster(HEAD.address))
    assert str(e.value) == ("the deploy failed: model-az: a replica needs 4 CPUs, and no node "
                            "of the cluster has that many (with --schedule-timeout 0, a "
                            "cluster that adds nodes may place it later)")
    assert ran == []
    # --schedule-timeout 0 (a cluster that adds nodes): said, and deployed
    monkeypatch.setattr(d, "wait_running", lambda *a, **k: None)
    said: list[str] = []
    d.deploy(config, ClusterSettings(), None, d.Cluster(HEAD.address), schedule_timeout=0,
             on_wait=said.append)
    assert said == ["model-az: a replica needs 4 CPUs, and no node of the cluster has that "
                    "many: requests for it wait until a node that has joins"]
    assert ran == ["deployed"]


def test_another_port_than_serve_listens_on_is_refused(ray_faked, monkeypatch):
    """Ray Serve keeps the address it started with: a redeploy with a new --port said the app
    was at the new port while it answered on the old one."""
    apps, done = ray_faked
    apps["justllm"] = "RUNNING"
    ran: list[str] = []
    monkeypatch.setattr(d.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(d.serve, "_run", lambda *a, **k: ran.append("deployed"))
    with pytest.raises(JustLLMError) as e:
        d.deploy(None, ClusterSettings(port=9000), None, d.Cluster(HEAD.address))
    assert str(e.value).startswith("Ray Serve on this cluster already listens on "
                                   "127.0.0.1:8000 (it keeps the address it started with): "
                                   "deploy with --host 127.0.0.1 --port 8000")
    assert ran == [] and apps == {"justllm": "RUNNING"} and done == []


@pytest.mark.parametrize("local, other_app, redeploy", [
    (True, False, False), (True, True, False), (False, False, False), (True, False, True)])
def test_a_failed_app_is_removed_only_when_it_is_all_there_is(ray_faked, monkeypatch, local,
                                                              other_app, redeploy):
    """A failed deploy left the head it started running, with the failed app, unsaid. A
    failed redeploy of the app that ran alone there deleted it and stopped the head."""
    apps, done = ray_faked
    if other_app:
        apps["other"] = "RUNNING"
    if redeploy:
        apps["justllm"] = "RUNNING"

    def fail(app, name, route_prefix, _blocking):
        apps[name] = "DEPLOY_FAILED"

    monkeypatch.setattr(d.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(d.serve, "_run", fail)
    monkeypatch.setattr(d, "_why_failed", lambda app: "model-bad: ModelLoadError: not a GGUF")
    cluster = d.Cluster(HEAD.address, HEAD if local else None)
    with pytest.raises(JustLLMError) as e:
        d.deploy(None, ClusterSettings(), None, cluster)
    assert str(e.value).startswith("the deploy failed: model-bad: ModelLoadError")
    if local and not other_app and not redeploy:  # gone, head and all
        assert "justllm" not in apps and done == ["head stopped"]
        assert "stays" not in str(e.value)
    else:
        assert apps["justllm"] == "DEPLOY_FAILED" and done == []
        assert "'justllm cluster down --name justllm' removes it" in str(e.value)


# Ray Serve's controller message, as ray/serve/_private/deployment_state.py words it.
UNPLACED = ("Deployment 'model-demo' in application 'justllm' has 2 replicas that have taken "
            "more than 30s to be scheduled. This may be due to waiting for the cluster to "
            "auto-scale or for a runtime environment to be installed. Resources required for "
            "each replica: {'CPU': 1.0, 'GPU': 1.0}, total resources available: "
            "{'CPU': 2.0}. Use `ray status` for more details.")


def test_rays_message_about_unplaced_replicas_is_read():
    assert d.unplaced(UNPLACED) == (2, "{'CPU': 1.0, 'GPU': 1.0}", "{'CPU': 2.0}")
    assert d.loading(UNPLACED) is None
    assert d.unplaced("Deployment 'model-demo' has 1 replicas that have taken more than 30s "
                      "to initialize.") is None


class Clock:
    """time.monotonic and time.sleep for the wait: sleeping moves the clock."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def deploying_for_ever(monkeypatch, apps: dict, message: str, plain_polls: int) -> Clock:
    """A fake Serve whose app deploys without end: ``plain_polls`` polls of nothing said,
    then the model deployment's ``message`` (Ray's) at every poll; the wait on a fake clock."""
    clock = Clock()
    pending = {"model-demo": SimpleNamespace(message=message),
               "ingress": SimpleNamespace(message="")}
    statuses = iter([app_status("DEPLOYING")] * plain_polls)
    monkeypatch.setattr(d.serve, "status", lambda: SimpleNamespace(applications={
        name: next(statuses, app_status("DEPLOYING", pending)) for name in apps}))
    monkeypatch.setattr(d.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(d.serve, "_run", lambda app, name, route_prefix, _blocking:
                        apps.__setitem__(name, "DEPLOYING"))
    monkeypatch.setattr(d, "wait_running", partial(d.wait_running, clock=clock,
                                                   sleep=clock.sleep))
    return clock


def test_replicas_no_node_can_hold_fail_the_deploy_after_the_timeout(ray_faked, monkeypatch):
    """``gpu: true`` on a cluster without GPUs: serve.run waited for ever, and every request
    with it. Now the wait is said once, the deploy fails after --schedule-timeout naming the
    deployment and the resources, and the app it left is removed (it was alone on the head
    this deploy started)."""
    apps, done = ray_faked
    clock = deploying_for_ever(monkeypatch, apps, UNPLACED, plain_polls=3)
    heard: list[str] = []
    with pytest.raises(JustLLMError) as e:
        d.deploy(None, ClusterSettings(), None, d.Cluster(HEAD.address, HEAD),
                 schedule_timeout=45, on_wait=heard.append)
    assert str(e.value) == ("the deploy failed: model-demo: 2 replica(s) found no node in 45 s: "
                            "each needs {'CPU': 1.0, 'GPU': 1.0}, the cluster has "
                            "{'CPU': 2.0} (a cluster that adds nodes may need a longer "
                            "--schedule-timeout)")
    assert 45 <= clock.now < 46
    assert heard == ["model-demo: 2 replica(s) wait for a node with {'CPU': 1.0, 'GPU': 1.0}; "
                     "the cluster has {'CPU': 2.0} (waiting up to 45 s: --schedule-timeout)"]
    assert "justllm" not in apps and done == ["head stopped"]


def test_without_a_schedule_timeout_the_deploy_waits_until_the_replicas_run(monkeypatch):
    clock = Clock()
    pending = {"model-demo": SimpleNamespace(message=UNPLACED)}
    statuses = iter([app_status("DEPLOYING", pending)] * 2000 + [app_status("RUNNING")])
    monkeypatch.setattr(d.serve, "status", lambda: SimpleNamespace(
        applications={"justllm": next(statuses)}))
    heard: list[str] = []
    d.wait_running("justllm", 0, heard.append, clock=clock, sleep=clock.sleep)
    assert clock.now == 1000 and next(statuses, None) is None
    assert len(heard) == 1 and "waiting up to" not in heard[0]


# Ray's words (deployment_state.py) for a replica whose constructor has run 30 s.
LOADING = ("Deployment 'model-demo' in application 'justllm' has 1 replicas that have taken "
           "more than 30s to initialize.\nThis may be caused by a slow __init__ or reconfigure "
           "method.")


def test_rays_message_about_loading_replicas_is_read():
    assert d.loading(LOADING) == (1, "30") and d.unplaced(LOADING) is None


def test_replicas_that_never_finish_loading_fail_the_deploy_after_the_start_timeout(
        ray_faked, monkeypatch):
    """A replica whose constructor hangs (a model on a stalled mount): Ray waits for it
    without end, and the deploy did, saying nothing. Now the wait is said once, and the deploy
    fails after --start-timeout, naming the deployment; the app it left is removed."""
    apps, done = ray_faked
    clock = deploying_for_ever(monkeypatch, apps, LOADING, plain_polls=60)  # (Ray: after 30 s)
    heard: list[str] = []
    with pytest.raises(JustLLMError) as e:
        d.deploy(None, ClusterSettings(), None, d.Cluster(HEAD.address, HEAD),
                 start_timeout=90, on_wait=heard.append)
    assert str(e.value) == ("the deploy failed: model-demo: 1 replica(s) did not finish "
                            "loading their model in 90 s (its log, in Ray's logs/serve folder "
                            "on its node, says how far it got; a larger --start-timeout waits "
                            "longer)")
    assert 90 <= clock.now < 91
    assert heard == ["model-demo: 1 replica(s) still loading their model after more than 30 s "
                     "(waiting up to 90 s in all: --start-timeout)"]
    assert "justllm" not in apps and done == ["head stopped"]


def test_a_slow_load_within_the_start_timeout_is_waited_for(monkeypatch):
    """Loading for longer than Ray's 30 s is said, not failed: the deploy goes on until the
    replicas run (a large model loads for minutes); a schedule timeout does not apply."""
    clock = Clock()
    # (the ingress loads no model: "ingress: ... still loading their model" misled)
    pending = {"model-demo": SimpleNamespace(message=LOADING),
               "ingress": SimpleNamespace(message=LOADING.replace("model-demo", "ingress"))}
    statuses = iter([app_status("DEPLOYING", pending)] * 1000 + [app_status("RUNNING")])
    monkeypatch.setattr(d.serve, "status", lambda: SimpleNamespace(
        applications={"justllm": next(statuses)}))
    heard: list[str] = []
    d.wait_running("justllm", 45, heard.append, start_timeout=0, clock=clock,
                   sleep=clock.sleep)
    assert clock.now == 500 and next(statuses, None) is None
    assert heard == ["model-demo: 1 replica(s) still loading their model after more than 30 s (waiting "
                     "without end: --start-timeout 0)",
                     "ingress: 1 replica(s) still starting after more than 30 s (waiting "
                     "without end: --start-timeout 0)"]


@pytest.mark.parametrize("apps, name, says, stopped", [
    # The app asked for, alone on the head justllm started: it and the head go.
    ({"justllm": "RUNNING"}, "justllm", ["deleted the app 'justllm'",
                                          "stopped the local Ray head at 127.0.0.1:1"], True),
    # Another app is left: the head stays (it was stopped under it).
    ({"justllm": "RUNNING", "other": "RUNNING"}, "other", [
        "deleted the app 'other'",
        "the local Ray head at 127.0.0.1:1 keeps running: it serves justllm"], False),
    # A name that is not there: nothing is touched (the head was stopped, and 'down' said so).
    ({"justllm": "RUNNING"}, "typo", "nothing deployed as 'typo' on the Ray cluster at "
                                     "127.0.0.1:1 (it runs: justllm)", False),
    # Nothing at all on the head justllm started: it is stopped.
    ({}, "justllm", ["stopped the local Ray head at 127.0.0.1:1"], True),
])
def test_down_stops_the_local_head_only_when_nothing_else_runs_there(ray_faked, monkeypatch,
                                                                      apps, name, says,
                                                                      stopped):
    running, done = ray_faked
    running.update(apps)
    monkeypatch.setattr(d, "find_cluster", lambda: d.Cluster(HEAD.address, HEAD))
    monkeypatch.setattr(d.serve, "shutdown", lambda: done.append("serve shut down"))
    if isinstance(says, str):
        with pytest.raises(d.NothingDeployed, match=re.escape(says)):
            d.down(name)
        assert running == apps
    else:
        assert d.down(name) == says
        assert name not in running
    assert ("head stopped" in done) == stopped
    assert ("serve shut down" in done) == (stopped and bool(apps))


def test_an_app_ray_refused_to_create_is_not_said_to_stay(ray_faked, monkeypatch):
    """A second app at the route prefix '/' is refused before Ray makes it; the line said the
    failed app stayed on the cluster and that 'down --name' removed it."""
    apps, done = ray_faked
    apps["justllm"] = "RUNNING"

    def refuse(app, name, route_prefix, _blocking):
        raise RuntimeError('RayServeException: Prefix / is being used by application "justllm".')

    monkeypatch.setattr(d.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(d.serve, "_run", refuse)
    with pytest.raises(JustLLMError) as e:
        d.deploy(None, ClusterSettings(app="other"), None, d.Cluster(HEAD.address, HEAD))
    assert str(e.value) == ('the deploy failed: RayServeException: Prefix / is being used by '
                            'application "justllm".')
    assert apps == {"justllm": "RUNNING"} and done == []


@pytest.mark.parametrize("nodes, address, checked", [
    ([{"CPU": 2.0}], "127.0.0.1:1", True),  # this machine alone: its files are the replicas'
    ([{"CPU": 2.0}, {"CPU": 2.0}], "127.0.0.1:1", False),  # each node resolves its own
    ([{"CPU": 2.0}], "ray://10.0.0.7:10001", False),  # a Ray Client's cluster is elsewhere
])
def test_what_replicas_here_would_refuse_is_refused_before_serve_starts(
        ray_faked, monkeypatch, nodes, address, checked):
    """A bad chat-template failed only inside the replicas, on a cluster already running
    too (a minute of Ray's retries)."""
    started: list[str] = []
    monkeypatch.setattr(d, "cluster_nodes", lambda: nodes)
    monkeypatch.setattr(d.serve, "start", lambda **kwargs: started.append("serve"))
    monkeypatch.setattr(d.serve, "_run", lambda *a, **k: started.append("deployed"))
    monkeypatch.setattr(d, "wait_running", lambda *a, **k: None)

    def refuse() -> None:
        raise ValueError("model 'demo': --chat-template 'nope' is neither ...")

    cluster = d.Cluster(address)
    if checked:
        with pytest.raises(ValueError, match="--chat-template 'nope'"):
            d.deploy(None, ClusterSettings(), None, cluster, check_here=refuse)
        assert started == []
    else:
        d.deploy(None, ClusterSettings(), None, cluster, check_here=refuse)
        assert started == ["serve", "deployed"]


@pytest.mark.parametrize("fresh, other_app", [(True, False), (True, True), (False, False)])
def test_an_interrupted_deploy_stops_the_head_it_started(ray_faked, monkeypatch, fresh,
                                                         other_app):
    """Ctrl-C while the replicas loaded left the head this deploy had just started running,
    with the app. The head goes (Serve shut down first: the head then stops in seconds),
    unless another app came onto it; a cluster that was there before keeps the app as Ray
    has it (the command says so)."""
    apps, done = ray_faked
    if other_app:
        apps["other"] = "RUNNING"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(d.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(d.serve, "_run", lambda app, name, route_prefix, _blocking:
                        apps.__setitem__(name, "DEPLOYING"))
    monkeypatch.setattr(d, "wait_running", interrupted)
    shielded: list[str] = []

    @contextlib.contextmanager
    def shield():
        shielded.append("cleanup")
        yield

    with pytest.raises(KeyboardInterrupt):
        d.deploy(None, ClusterSettings(), None, d.Cluster(HEAD.address, HEAD, fresh=fresh),
                 shielded=shield)
    assert shielded == ["cleanup"]
    if fresh and not other_app:
        assert apps == {} and done == ["head stopped"]
    else:
        assert apps["justllm"] == "DEPLOYING" and done == []


def test_a_cluster_that_wants_an_auth_token_is_said_at_once(monkeypatch):
    """Ray's token auth: `ray start --head` turns it on wherever ~/.ray/auth_token is, and
    ray.init with an address sends no token unless RAY_AUTH_MODE=token; it retried for 20 s,
    printing C++ warnings, then said only that it failed to connect. (A gRPC server that
    refuses every call as a token-auth GCS refuses a call without its token.)"""
    from concurrent import futures

    import grpc

    def refuse(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken")

    class Refuser(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.unary_unary_rpc_method_handler(refuse)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers((Refuser(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
        assert d.gcs_refusal(f"127.0.0.1:{port}", 10) == (
            "it wants Ray's auth token: set RAY_AUTH_MODE=token, and the cluster's token in "
            "RAY_AUTH_TOKEN or ~/.ray/auth_token")
        monkeypatch.setenv("RAY_AUTH_MODE", "token")  # ray.init sends it: left to ray.init
        assert d.gcs_refusal(f"127.0.0.1:{port}", 10) is None
    finally:
        server.stop(None)


def test_a_ctrl_c_while_ray_connects_is_raised_once_it_has_connected(python_ctrl_c):
    """One raised inside ray.init (its core worker's constructor) left Ray half made: the
    deploy's process died of SIGSEGV as it exited."""
    import signal

    done: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with d._ctrl_c_held():
            signal.raise_signal(signal.SIGINT)
            done.append("connected")
    assert done == ["connected"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
