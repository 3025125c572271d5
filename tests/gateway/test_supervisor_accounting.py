"""The supervisor's bookkeeping, without processes: what a loading model and a stopping runner
count against max-loaded and max-memory, when a silent replica counts as hung, what a plugin's
routing policy may break (its constructor, its reasons in /metrics), and that keep_alive never
unloads a model that is never unloaded. (The same rules with real runners:
tests/gateway/test_gateway.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from justllm.gateway.config import Flags, load_config
from justllm.gateway.metrics import _own
from justllm.gateway.replica import Replica
from justllm.gateway.routing import POLICIES, Decision, Policy, RouteRequest
from justllm.gateway.supervisor import ModelUnavailable, Supervisor

FLAGS = Flags(frozenset({"max-seqs"}))
MIB = 2**20


def supervisor(tmp_path, models: dict, flags: Flags = FLAGS, **top) -> Supervisor:
    config = load_config({**top, "models": {name: {"source": "x.gguf", **entry}
                                            for name, entry in models.items()}}, flags)
    return Supervisor(config, tmp_path)


class DrainingRunner:
    """A runner process that drains until ``exit`` is set."""

    def __init__(self) -> None:
        self.exit = asyncio.Event()

    def alive(self) -> bool:
        return not self.exit.is_set()

    async def stop(self, grace: float) -> None:
        await self.exit.wait()


def test_a_loading_model_counts_every_replica_it_is_about_to_start(tmp_path):
    async def main() -> None:
        sup = supervisor(tmp_path, {"r": {"replicas": 2},
                                    "pd": {"prefill-replicas": 1, "decode-replicas": 2}})
        for state in sup.models.values():
            state.memory = 100 * MIB
        r, pd = sup.models["r"], sup.models["pd"]
        assert r.view().memory == 100 * MIB  # unloaded: as one runner, for a load's need
        r.status = pd.status = "loading"  # places claimed; no replica started yet
        assert (r.view().memory, pd.view().memory) == (200 * MIB, 300 * MIB)
        assert sup.memory_used() == 500 * MIB
    asyncio.run(main())


def test_two_multi_replica_models_loading_at_once_never_exceed_max_memory(tmp_path):
    """Both loads fitted: each saw the other as one runner while it loaded (4 runners under
    a limit of 3)."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"r1": {"replicas": 2}, "r2": {"replicas": 2}},
                         **{"max-memory": 300 * MIB})
        r1, r2 = sup.models["r1"], sup.models["r2"]
        r1.memory = r2.memory = 100 * MIB
        r1.active = r2.active = 1  # both wanted by a request
        await sup._make_room(r1, 0)
        assert r1.status == "loading"
        second = asyncio.ensure_future(sup._make_room(r2, 0))
        await asyncio.sleep(0.2)
        assert not second.done() and r2.status == "unloaded"  # waits for r1 to go idle
        second.cancel()
    asyncio.run(main())


def test_a_stopping_runner_holds_its_place_until_it_exits(tmp_path):
    """An unloaded model's runners drain; a model started meanwhile ran beside them, past
    max-loaded."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"alpha": {}, "beta": {}}, **{"max-loaded": 1})
        alpha, beta = sup.models["alpha"], sup.models["beta"]
        runner = DrainingRunner()
        sup._stopping[runner] = alpha  # what _detach records for alpha's runner
        stopping = asyncio.ensure_future(sup._stop_all([runner]))
        load = asyncio.ensure_future(sup._make_room(beta, 0))
        await asyncio.sleep(0.2)
        assert not load.done() and beta.status == "unloaded"
        stopping.cancel()  # the unload's client went away: the stop goes on without it
        await asyncio.sleep(0.1)
        assert not load.done() and runner in sup._stopping
        runner.exit.set()  # it exits: its place is free, the waiting load goes on
        await asyncio.wait_for(load, 5)
        assert beta.status == "loading" and not sup._stopping
        assert (alpha.unloads, beta.unloads) == (1, 0)
    asyncio.run(main())


def test_a_model_unloaded_while_its_load_waits_for_room_is_not_started(tmp_path):
    """Unloaded while its eviction of another model drained, a model was started all the
    same, and the next model beside it: two runners under max-loaded 1."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"alpha": {}, "beta": {}, "gamma": {}},
                         **{"max-loaded": 1})
        alpha, beta, gamma = (sup.models[n] for n in ("alpha", "beta", "gamma"))
        started: list[str] = []

        async def spawn_ready(state, replica):
            started.append(state.spec.name)
            replica.runner = None
        sup._spawn_ready = spawn_ready
        draining = DrainingRunner()
        alpha.status = "loaded"
        alpha.replicas.append(Replica("0", runner=draining, status="ready"))

        # beta evicts idle alpha and waits for its runner to exit; it is unloaded meanwhile
        beta.load_task = load = asyncio.ensure_future(sup._load(beta))
        await asyncio.sleep(0.2)
        assert beta.status == "loading" and draining in sup._stopping
        assert not await sup.unload(beta)  # (no runner of its own yet)
        with pytest.raises(ModelUnavailable) as e:  # at once, while alpha still drains
            await asyncio.wait_for(load, 5)
        assert e.value.code == "model_unloaded" and beta.status == "unloaded"
        assert draining in sup._stopping  # alpha's place is held until its runner exits
        draining.exit.set()
        await asyncio.sleep(0.1)
        assert not sup._stopping

        # gamma waits for busy beta... which is unloaded while gamma waits: gamma is the
        # one that gives up at once, and its place is never claimed
        beta.status, beta.active = "loaded", 1
        gamma.load_task = load = asyncio.ensure_future(sup._load(gamma))
        await asyncio.sleep(0.2)
        assert not load.done() and gamma.status == "unloaded"
        await sup.unload(gamma)
        with pytest.raises(ModelUnavailable) as e:
            await asyncio.wait_for(load, 5)
        assert e.value.code == "model_unloaded" and gamma.status == "unloaded"
        assert started == []
        await sup.close()
    asyncio.run(main())


def test_a_silent_replica_is_restarted_health_timeout_after_its_last_answer(tmp_path):
    """The count began at the second failed poll (a hung runner's poll takes its whole
    timeout), so a runner silent for health-timeout seconds ran on for seconds more."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"alpha": {}}, **{"health-timeout": 5})
        state = sup.models["alpha"]
        replica = Replica("0", status="ready")
        state.replicas.append(replica)

        async def silent(*_, **__):
            raise httpx.ReadTimeout("no answer")
        sup._http = SimpleNamespace(get=silent, aclose=sup._http.aclose)
        replica.polled = time.monotonic() - 2  # answered 2 s ago
        await sup.poll(state, replica)
        await sup.poll(state, replica)
        assert replica.status == "unhealthy" and replica.restarts == 0  # 2 s: not hung yet
        replica.polled = replica.unhealthy_since = time.monotonic() - 6
        other = Replica("1", status="ready", failures=1)
        other.polled = time.monotonic() - 6  # silent as long: hung at its second failure
        state.replicas.append(other)
        await sup.poll(state, replica)
        await sup.poll(state, other)
        assert replica.status == other.status == "restarting"
        assert replica.restarts == other.restarts == 1
        assert "did not answer for 5 s" in other.error
        await sup.close()
    asyncio.run(main())


# ---- plugins' routing policies -----------------------------------------------------------------


def with_policies(**policies: type[Policy]) -> Flags:
    return Flags(FLAGS.names, routing_policies={**POLICIES, **policies})


def test_a_plugin_policy_whose_constructor_raises_leaves_the_gateway_up(tmp_path, caplog):
    """It stopped the whole gateway at start-up: every model down for one plugin."""
    class Broken(Policy):
        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError("no config file")

    sup = supervisor(tmp_path, {"m": {"urls": ["http://10.0.0.1:1", "http://10.0.0.2:1"],
                                      "replicas": 0, "routing": "broken"},
                                "other": {}}, with_policies(broken=Broken))
    state = sup.models["m"]
    assert "routing policy broken could not be made" in caplog.text
    assert "no config file" in caplog.text
    a, b = state.replicas
    a.in_flight = 3  # the least loaded replica serves, as when a policy's pick fails
    chosen = sup.route(state, RouteRequest("hi"), set())
    assert chosen is b and state.router.counts == {"policy-failed": 1}
    assert sup.models["other"].router.counts == {}  # the other models are untouched


def test_a_plugin_policys_odd_reasons_are_counted_as_text_and_metrics_stay_valid(tmp_path):
    """An unhashable reason failed every request of the model; reasons of mixed types failed
    /metrics for every model; a reason with a quote or a newline broke the page."""
    reasons = iter([["x"], None, "x", 'say "hi"\nnow', "back\\slash", None])

    class Odd(Policy):
        def pick(self, request, available, replicas):
            return Decision(available[0].id, next(reasons))

    sup = supervisor(tmp_path, {"m": {"urls": ["http://10.0.0.1:1", "http://10.0.0.2:1"],
                                      "replicas": 0, "routing": "odd"}},
                     with_policies(odd=Odd))
    state = sup.models["m"]
    for _ in range(6):
        replica = sup.route(state, RouteRequest("hi"), set())
        sup.done(replica)
    assert state.router.counts == {"['x']": 1, "None": 2, "x": 1, 'say "hi"\nnow': 1,
                                   "back\\slash": 1}
    page = _own(sup)
    samples = {s.labels["reason"]: s.value
               for family in text_string_to_metric_families(page)
               for s in family.samples if s.name == "justllm_gateway_routing_decisions_total"}
    assert samples["None"] == 2 and samples["['x']"] == 1 and samples["x"] == 1
    assert samples['say "hi"\nnow'] == 1 and samples["back\\slash"] == 1  # escaped, read back
    assert samples["policy-failed"] == 0  # the built-in reasons are listed too


# ---- keep_alive and a model never unloaded ------------------------------------------------------


def test_keep_alive_never_unloads_a_model_with_min_replicas(tmp_path):
    """min-replicas >= 1: never unloaded (README), but a request's keep_alive 0 overrode the
    ttl and unloaded it for every client."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"pinned": {"min-replicas": 1, "max-replicas": 2},
                                    "plain": {}})
        pinned, plain = sup.models["pinned"], sup.models["plain"]
        assert pinned.pinned and not plain.pinned
        for state in (pinned, plain):
            state.status, state.active = "loaded", 1
            state.replicas.append(Replica("0", status="ready"))
        sup.end(pinned, 0.0)
        sup.end(plain, 0.0)
        assert pinned.keep_alive is None and pinned.ttl == -1 and pinned.status == "loaded"
        assert plain.status == "unloaded"  # honoured there (and forgotten with the load)
        await sup.close()
    asyncio.run(main())


def test_a_preload_is_no_request_waiting_for_a_load(tmp_path):
    """`justllm ps` said "1 request(s) waiting for a load" while preloads ran, with no
    client, and a preload took a place under max-waiting."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"p": {}, "q": {}}, **{"max-waiting": 1})
        started = asyncio.Event()

        async def slow_load(state) -> None:
            started.set()
            await asyncio.sleep(30)

        sup._load = slow_load  # type: ignore[method-assign]
        preload = asyncio.ensure_future(sup._preload(sup.models["p"]))
        await started.wait()
        assert sup.waiting == 0
        client = asyncio.ensure_future(sup.acquire(sup.models["q"]))  # a place is free
        await asyncio.sleep(0.05)
        assert sup.waiting == 1 and not client.done()
        for task in (preload, client):
            task.cancel()
        await asyncio.gather(preload, client, return_exceptions=True)
        assert sup.waiting == 0 and sup.models["p"].active == sup.models["q"].active == 0
    asyncio.run(main())


def test_a_client_giving_up_on_a_load_lets_the_load_waiting_for_room_evict_it(tmp_path):
    """max-loaded 1: beta loaded for a client that then left (its acquire ended without a
    request ending); alpha's load waiting for room was never woken, and timed out with the
    idle beta loaded beside nothing (every request for alpha a 503 until another request
    ended somewhere)."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"alpha": {}, "beta": {}}, **{"max-loaded": 1})
        alpha, beta = sup.models["alpha"], sup.models["beta"]
        beta.status = "loading"
        beta.load_task = asyncio.get_running_loop().create_future()  # a load that goes on
        waiter = asyncio.ensure_future(sup.acquire(beta))  # the client waiting for it
        await asyncio.sleep(0.1)
        assert beta.active == 1
        alpha.active = 1
        room = asyncio.ensure_future(sup._make_room(alpha, alpha.detached))
        await asyncio.sleep(0.2)
        assert not room.done()  # beta is busy: its client waits
        beta.status = "loaded"  # it loaded ... and its client left
        waiter.cancel()
        await asyncio.wait_for(room, 2)  # woken: beta, idle, was the victim
        assert beta.status == "unloaded" and alpha.status == "loading"
        beta.load_task.cancel()
        await sup.close()
    asyncio.run(main())


def test_a_model_with_min_replicas_is_never_evicted_for_another(tmp_path):
    """The README says never unloaded; max-loaded evicted it like any idle model (and a
    max-loaded every such model fills is refused when the gateway starts)."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"pinned": {"min-replicas": 1, "max-replicas": 2},
                                    "idle": {}, "new": {}}, **{"max-loaded": 2})
        pinned, idle, new = (sup.models[n] for n in ("pinned", "idle", "new"))
        pinned.status, pinned.last_used = "loaded", 1.0  # the least recently used
        idle.status, idle.last_used = "loaded", 2.0
        new.active = 1
        await asyncio.wait_for(sup._make_room(new, new.detached), 2)
        assert (pinned.status, idle.status, new.status) == ("loaded", "unloaded", "loading")
        await sup.close()
    asyncio.run(main())
    with pytest.raises(ValueError, match=r"max-loaded is 1 and pinned \(min-replicas >= 1\) "
                                         r"never unload: other could never load"):
        supervisor(tmp_path, {"pinned": {"min-replicas": 1, "max-replicas": 2}, "other": {}},
                   **{"max-loaded": 1})


def test_a_model_whose_last_replica_gave_up_is_failed_and_a_load_tries_again(tmp_path):
    """It stayed "loaded" (in /v1/models, ps, the loaded gauge) answering "all failed", and
    POST /models/load could not revive it; an autoscaled pool's failed replicas piled up,
    one more every few seconds."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"fixed": {"replicas": 2},
                                    "scaled": {"min-replicas": 1, "max-replicas": 3}})
        fixed, scaled = sup.models["fixed"], sup.models["scaled"]
        for state in (fixed, scaled):
            state.status = "loaded"
            state.replicas += [Replica("0", status="ready"), Replica("1", status="failed",
                                                                     error="gone")]
        sup._gave_up(fixed, fixed.replicas[1])  # a fixed replica: kept, failed
        assert [r.status for r in fixed.replicas] == ["ready", "failed"]
        sup._gave_up(scaled, scaled.replicas[1])  # the pool's: dropped
        assert [r.id for r in scaled.replicas] == ["0"] and scaled.status == "loaded"
        last = fixed.replicas[0]
        last.status, last.error = "failed", "model not found: x.gguf"
        sup._gave_up(fixed, last)  # none left to serve: the model failed
        assert fixed.status == "failed" and fixed.replicas == []
        with pytest.raises(ModelUnavailable) as e:
            await sup.acquire(fixed)
        assert e.value.code == "model_failed" and "model not found: x.gguf" in str(e.value)
        assert fixed.active == 0
        tried: list[str] = []

        async def spawn_ready(state, replica):
            tried.append(replica.id)
            replica.runner = None
        sup._spawn_ready = spawn_ready
        await asyncio.wait_for(sup.load(fixed), 5)  # POST /models/load: started again
        assert fixed.status == "loaded" and tried == ["0", "1"]
        await sup.close()
    asyncio.run(main())


def test_a_request_waiting_for_a_restart_says_why_it_ends(tmp_path):
    """Unloaded, or the gateway stopping, while a request waited for a restarting replica:
    it got 503 model_failed "no replica that can serve: all failed" (no Retry-After), and a
    load waiting for room during a shutdown got model_unloaded with a Retry-After."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"a": {}, "b": {}}, **{"max-loaded": 1})
        a, b = sup.models["a"], sup.models["b"]
        a.status = "loaded"
        a.replicas.append(Replica("0", status="restarting"))
        waiting = asyncio.ensure_future(sup.acquire(a))
        await asyncio.sleep(0.1)
        await sup.unload(a)
        with pytest.raises(ModelUnavailable) as e:
            await asyncio.wait_for(waiting, 2)
        assert e.value.code == "model_unloaded" and a.active == 0
        a.status, a.active = "loaded", 1  # busy: b's load waits for room
        a.replicas.append(Replica("0", status="restarting"))
        waiting = asyncio.ensure_future(sup.wait_routable(a))
        b.active = 1
        b.load_task = room = asyncio.ensure_future(sup._make_room(b, b.detached))
        await asyncio.sleep(0.1)
        await sup.close()
        for task in (waiting, room):
            with pytest.raises(ModelUnavailable) as e:
                await asyncio.wait_for(task, 2)
            assert e.value.code == "shutting_down"
    asyncio.run(main())


def test_a_model_whose_file_is_gone_evicts_nothing(tmp_path):
    """A source path deleted (or moved) after the gateway started passed the header check
    (only a file there was read): the idle working model was evicted, then three starts
    failed with 'model not found'."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"working": {},
                                    "gone": {"source": str(tmp_path / "gone.gguf")}},
                         **{"max-loaded": 1})
        working, gone = sup.models["working"], sup.models["gone"]
        working.status = "loaded"
        with pytest.raises(ModelUnavailable) as e:
            await asyncio.wait_for(sup.acquire(gone), 5)
        assert e.value.code == "model_failed"
        assert f"model not found: {tmp_path / 'gone.gguf'}" in str(e.value)
        assert working.status == "loaded" and gone.status == "failed"
        await sup.close()
    asyncio.run(main())


def test_a_replicas_restart_counter_never_goes_backwards_across_loads(tmp_path):
    """Replicas are made anew at each load, and the counter series with them: 2 became 0
    after an unload and a load, which Prometheus reads as a reset."""
    from justllm.gateway.metrics import _replicas

    async def main() -> None:
        sup = supervisor(tmp_path, {"a": {}})
        a = sup.models["a"]
        sup._restart = lambda state, replica: None  # (no process here)

        def restarts() -> float:
            return next(s.value for family in text_string_to_metric_families(
                "\n".join(_replicas(sup)) + "\n") for s in family.samples
                if s.name == "justllm_gateway_replica_restarts_total")

        a.status = "loaded"
        a.replicas.append(Replica("0", status="ready"))
        sup._restart_failed(a, a.replicas[0], "died")
        sup._restart_failed(a, a.replicas[0], "died")
        assert restarts() == 2
        a.replicas = [Replica("0", status="ready")]  # unloaded, loaded again
        assert restarts() == 2
        await sup.close()
    asyncio.run(main())


class StopNoted:
    """A live runner whose stop is noted in ``stopped`` as ``label`` (no process here)."""

    def __init__(self, stopped: list[str], label: str) -> None:
        self.stopped, self.label = stopped, label

    def alive(self) -> bool:
        return True

    async def stop(self, grace: float) -> None:
        self.stopped.append(self.label)


def test_a_replica_retired_while_it_did_not_serve_is_stopped_at_once(tmp_path):
    """The autoscaler retires unhealthy (hung) replicas first; their requests then waited the
    drain and a minute more on a process that answered nothing."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"a": {"min-replicas": 1, "max-replicas": 2}})
        a = sup.models["a"]
        stopped: list[str] = []
        hung = Replica("1", runner=StopNoted(stopped, "hung"),  # type: ignore[arg-type]
                       status="unhealthy", in_flight=1)
        busy = Replica("0", runner=StopNoted(stopped, "hung"),  # type: ignore[arg-type]
                       status="ready", in_flight=1)
        a.replicas += [busy, hung]
        sup._retire(a, hung)
        sup._retire(a, busy)
        await asyncio.sleep(0.3)
        assert stopped == ["hung"] and a.replicas == [busy]  # the busy one drains first
        await sup.close()
    asyncio.run(main())


def test_a_replica_added_after_one_was_retired_goes_to_the_gpu_left_free(tmp_path):
    """Up, down, up again on gpus [0, 1]: the third replica (id 2) went to gpus[2 % 2], GPU 0,
    beside replica 0, and GPU 1 stayed idle."""
    from justllm.gateway.autoscale import AutoscaleConfig

    async def main() -> None:
        sup = supervisor(tmp_path, {"a": {"min-replicas": 1, "max-replicas": 2,
                                          "gpus": [0, 1]}})
        a = sup.models["a"]
        sup._restart = lambda state, replica: None  # (no process here)
        a.status = "loaded"
        a.replicas.append(Replica("0", status="ready", gpu=0, in_flight=4))
        config = AutoscaleConfig(1, 2, target_ongoing=2, upscale_delay=0, downscale_delay=0)
        sup._scale_pool(a, "both", config, 0.0)
        assert [(r.id, r.gpu) for r in a.replicas] == [("0", 0), ("1", 1)]
        a.replicas[1].status = "stopping"  # retired, draining
        sup._scale_pool(a, "both", config, 1.0)
        assert [(r.id, r.gpu) for r in a.replicas] == [("0", 0), ("1", 1), ("2", 1)]
        await sup.close()
    asyncio.run(main())


def test_a_replica_added_takes_the_least_id_no_replica_holds(tmp_path):
    """Ids only grew: every scale-up made a new log file (MODEL@7.log, ...) and a new value of
    every series' replica label, without end. The least id no replica holds is taken (not
    one a retired replica still holds while it drains, nor while its runner stops)."""
    from justllm.gateway.autoscale import AutoscaleConfig

    async def main() -> None:
        sup = supervisor(tmp_path, {"a": {"min-replicas": 1, "max-replicas": 3}})
        a = sup.models["a"]
        sup._restart = lambda state, replica: None  # (no process here)
        a.status = "loaded"
        a.replicas += [Replica("0", status="ready", in_flight=4),
                       Replica("1", status="stopping"),  # retired, draining
                       Replica("2", status="ready", in_flight=4)]
        config = AutoscaleConfig(1, 3, target_ongoing=2, upscale_delay=0, downscale_delay=0)
        sup._scale_pool(a, "both", config, 0.0)
        assert [r.id for r in a.replicas] == ["0", "1", "2", "3"]
        del a.replicas[1:]  # 1 and 3 are gone; 2 left its list but its runner still stops
        sup._stopping[type("Runner", (), {"replica": "2"})()] = a
        sup._scale_pool(a, "both", config, 1.0)
        assert [r.id for r in a.replicas] == ["0", "1"]
        a.replicas[0].in_flight = a.replicas[1].in_flight = 4
        sup._scale_pool(a, "both", config, 2.0)
        assert [r.id for r in a.replicas] == ["0", "1", "3"]
        sup._stopping.clear()
        await sup.close()
    asyncio.run(main())


def test_a_scale_up_cut_short_by_max_memory_says_what_it_started_and_no_room_once(
        tmp_path, caplog):
    """Room for one replica more of the four wanted: the log said "up to 4 replicas" as two
    ran; then "no room under max-memory" at every decision (with upscale-delay 0, four times
    a second)."""
    from justllm.gateway.autoscale import AutoscaleConfig

    async def main() -> None:
        sup = supervisor(tmp_path, {"a": {"min-replicas": 1, "max-replicas": 4}},
                         **{"max-memory": 250 * MIB})
        a = sup.models["a"]
        a.memory = 100 * MIB
        sup._restart = lambda state, replica: None  # (no process here)
        a.status = "loaded"
        a.replicas.append(Replica("0", status="ready", in_flight=8))
        config = AutoscaleConfig(1, 4, target_ongoing=1, upscale_delay=0, downscale_delay=0)
        for now in range(5):
            sup._scale_pool(a, "both", config, float(now))
        assert [r.id for r in a.replicas] == ["0", "1"] and a.scaled["both", "up"] == 1
        await sup.close()

    with caplog.at_level("WARNING", logger="justllm.gateway.supervisor"):
        asyncio.run(main())
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("autoscaler: model a up to 2 replicas: 8.0 requests per "
                              "replica"), said
    assert "4 wanted, no room for more under max-memory" in said[0]
    assert said[1:] == ["autoscaler: model a wants 4 replicas; no room under max-memory"]


def test_a_busy_replica_retired_while_its_polls_go_unanswered_finishes_its_requests(tmp_path):
    """A runner too busy to answer two polls in time is ``unhealthy``, and the autoscaler
    retires such replicas first: it was stopped at once, cutting its streams, though it
    would have been judged hung only health-timeout after its last answer."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"a": {"min-replicas": 1, "max-replicas": 2}})
        a = sup.models["a"]
        stopped: list[str] = []
        slow = Replica("1", runner=StopNoted(stopped, "slow"),  # type: ignore[arg-type]
                       status="unhealthy", in_flight=1, unhealthy_since=time.monotonic())
        a.replicas.append(slow)
        sup._retire(a, slow)
        for _ in range(5):
            await asyncio.sleep(0.1)
        assert stopped == [] and slow.status == "stopping"  # its request goes on
        slow.in_flight = 0  # it ended
        while not stopped:
            await asyncio.sleep(0.05)
        assert a.replicas == []
        await sup.close()
    asyncio.run(main())


def test_the_autoscalers_ongoing_requests_are_the_load_it_decides_on(tmp_path):
    """A retired replica draining its requests was counted in the series (and with its last
    poll's load for as long as it drained), not in the decisions: the series read above the
    target while the autoscaler, rightly, added nothing."""
    from justllm.gateway.metrics import _replicas

    async def main() -> None:
        sup = supervisor(tmp_path, {"a": {"min-replicas": 1, "max-replicas": 2}})
        a = sup.models["a"]
        a.status = "loaded"
        a.replicas += [Replica("0", status="ready", in_flight=1),
                       Replica("1", status="stopping", in_flight=3, others=2)]
        values = {s.name: s.value for family in text_string_to_metric_families(
            "\n".join(_replicas(sup)) + "\n") for s in family.samples
            if s.name.startswith("justllm_autoscaler_")}
        assert values["justllm_autoscaler_ongoing_requests"] == 1
        assert values["justllm_autoscaler_replicas"] == 1
        await sup.close()
    asyncio.run(main())


def test_a_scale_to_zero_is_said_and_a_preload_cut_by_a_shutdown_is_no_failure(
        tmp_path, caplog):
    """min-replicas 0: every other change of a model's replicas was logged, not its unload
    after ttl; and a gateway stopped during start-up logged "preload failed: the server is
    shutting down"."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"z": {"min-replicas": 0, "max-replicas": 2, "ttl": 0.1},
                                    "p": {"min-replicas": 1, "max-replicas": 2}})
        z = sup.models["z"]
        z.status, z.last_used = "loaded", time.monotonic()
        watch = asyncio.ensure_future(sup._watch_loop())
        while z.status == "loaded":
            await asyncio.sleep(0.05)
        sup._closing = True
        await watch
        await sup._preload(sup.models["p"])
        await sup.close()

    with caplog.at_level("INFO", logger="justllm.gateway.supervisor"):
        asyncio.run(main())
    said = [r.getMessage() for r in caplog.records]
    assert said == ["model z: idle for its ttl of 0.1 s; unloading"], said


def test_a_replica_that_lacked_a_runtime_adapter_holds_it_again_after_a_load(tmp_path):
    """Replicas that could not load an adapter when they restarted are skipped for it; a
    load in place that every replica took left them skipped for good, and with every other
    replica gone (failed, or being retired) the adapter is forgotten."""
    from justllm.gateway import lora

    async def main() -> None:
        sup = supervisor(tmp_path, {"a": {"replicas": 2}})
        a = sup.models["a"]
        a.status = "loaded"
        a.replicas += [Replica("0", remote="http://r0", status="ready"),
                       Replica("1", remote="http://r1", status="ready")]
        a.runtime_lora["sql"] = b'{"lora_name": "sql", "lora_path": "/x"}'
        lora.absent(a, "sql", "1")
        assert a.lora_absent == {"sql": {"1"}} and "sql" in a.runtime_lora
        sup._http = httpx.AsyncClient(transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json={"ok": True})))
        req = lora.GatewayLoadLora(lora_name="sql", lora_path="/y", load_inplace=True)
        took = await lora._load(sup, a, "sql", req)
        assert [r.id for r in took] == ["0", "1"] and a.lora_absent["sql"] == set()
        a.replicas[0].status = "stopping"  # retired: only 1 would hold it, and it cannot
        lora.absent(a, "sql", "1")
        assert "sql" not in a.runtime_lora and "sql" not in a.lora_absent
        await sup.close()
    asyncio.run(main())


def test_a_model_whose_last_serving_replica_gave_up_beside_a_retiring_one_is_failed(tmp_path):
    """(the retiring replica only finishes its requests: the model was left loaded with no
    replica to serve once it went)"""
    async def main() -> None:
        sup = supervisor(tmp_path, {"s": {"min-replicas": 0, "max-replicas": 2}})
        s = sup.models["s"]
        s.status = "loaded"
        s.replicas += [Replica("0", status="stopping"), Replica("1", status="failed",
                                                                  error="gone")]
        sup._gave_up(s, s.replicas[1])
        assert s.status == "failed" and s.error == "gone" and s.replicas == []
        await sup.close()
    asyncio.run(main())


def test_a_pd_model_whose_decode_replicas_all_gave_up_is_failed(tmp_path):
    """Its prefill replica still served, so the model stayed loaded, and every request
    waited out load-timeout for a decode replica (then no_healthy_replica)."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"pd": {"prefill-replicas": 1, "decode-replicas": 1}})
        pd = sup.models["pd"]
        pd.status = "loaded"
        pd.replicas += [Replica("0", role="prefill", status="ready"),
                        Replica("1", role="decode", status="failed", error="gone")]
        sup._gave_up(pd, pd.replicas[1])
        assert pd.status == "failed" and pd.error == "gone" and pd.replicas == []
        await sup.close()
    asyncio.run(main())


def test_a_restart_that_fails_is_counted_and_said(tmp_path, caplog, monkeypatch):
    """A replica killed again while it restarted went unlogged, and the restart counter
    counted one restart for two."""
    import justllm.gateway.policy as policy_module

    async def main() -> None:
        sup = supervisor(tmp_path, {"a": {}})
        a = sup.models["a"]
        starts: list[int] = []

        async def spawn_ready(state, replica):
            starts.append(1)
            replica.runner = None
            if len(starts) == 1:
                raise RuntimeError("runner exited with -9 while starting")
            return None
        sup._spawn_ready = spawn_ready
        monkeypatch.setattr(policy_module, "restart_delay", lambda failures: 0.0)
        a.status = "loaded"
        a.replicas.append(Replica("0", status="ready"))
        sup._restart_failed(a, a.replicas[0], "died")
        for _ in range(100):
            await asyncio.sleep(0.01)
            if a.replicas[0].status == "ready":
                break
        assert a.replicas[0].status == "ready" and len(starts) == 2
        assert a.restarts == 2 and a.replicas[0].restarts == 2
        await sup.close()

    with caplog.at_level("WARNING", logger="justllm.gateway.supervisor"):
        asyncio.run(main())
    assert "model a replica 0: restart 1 failed: runner exited with -9 while starting" \
        in caplog.text


def test_only_a_load_a_client_waits_for_holds_other_models_requests_back(tmp_path):
    """A load waiting for room holds back new requests for the models it would unload
    while a client waits for it: not once every client gave up (a 503 'making way' for a load
    nobody wanted), nor for a preload."""
    async def main() -> None:
        sup = supervisor(tmp_path, {"a": {}, "x": {}}, **{"max-loaded": 1})
        a, x = sup.models["a"], sup.models["x"]
        a.status = "loaded"
        a.active = 1  # busy: x's load waits for it to go idle
        a.replicas.append(Replica("0", status="ready"))
        load = asyncio.ensure_future(sup._load(x))  # (no client: as a preload)
        await asyncio.sleep(0.1)
        assert sup._making_way == {"x": {"a"}} and not sup._makes_way(a)
        x.waiters = 1  # a client waits for x
        assert sup._makes_way(a)
        x.waiters = 0  # it gave up
        assert not sup._makes_way(a)
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
        assert sup._making_way == {}  # (cleared however the wait ends)
        await sup.close()
    asyncio.run(main())
