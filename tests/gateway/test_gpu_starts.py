"""``--gpu`` runners that size their KV pool from a GPU's free memory start one at a time per
GPU, so none counts memory another is about to take (policy.start_key; the supervisor holds
a lock per GPU from spawn to ready). The runners here are stand-ins that record when they
start and become ready: a real ``--gpu`` runner needs a CUDA build, and this CPU build
refuses ``--gpu`` (tests/engine/test_vram.py). The rest of the supervisor runs as it is."""

from __future__ import annotations

import asyncio

import pytest

from justllm.gateway import supervisor as sup
from justllm.gateway.config import Flags, load_config
from justllm.gateway.policy import start_key

FLAGS = Flags(frozenset({"gpu", "pool-blocks"}), {}, switches=frozenset({"gpu"}))


def test_only_gpu_runners_without_a_pool_size_start_in_turn():
    assert start_key({"gpu": True}, None) == "all"
    assert start_key({"gpu": True}, 1) == "1"
    assert start_key({"gpu": True, "pool-blocks": 2048}, 1) is None  # a fixed pool
    assert start_key({}, 0) is None  # CPU runners
    assert start_key({"gpu": False}, None) is None


class StandIn:
    """What the supervisor needs of a RunnerProcess: it becomes ready after 0.2 s."""

    log: list[tuple[str, str, float]] = []

    def __init__(self, spec, log_dir, drain, replica, gpu, role, api_key=None) -> None:
        self.name = f"{spec.name}/{replica}@{gpu}"
        self.url = "http://127.0.0.1:9"  # never called: no LoRA adapter is loaded at run time

    async def wait_ready(self, http, timeout) -> None:
        loop = asyncio.get_running_loop()
        self.log.append(("start", self.name, loop.time()))
        await asyncio.sleep(0.2)
        self.log.append(("ready", self.name, loop.time()))

    def alive(self) -> bool:
        return False

    def kill_now(self) -> None:
        pass

    async def stop(self, grace: float = 10.0) -> None:
        pass


def overlapping(log: list[tuple[str, str, float]]) -> int:
    """The most runners that were starting at the same time."""
    now = most = 0
    for event, _, _ in sorted(log, key=lambda e: (e[2], e[0] == "start")):
        now += 1 if event == "start" else -1
        most = max(most, now)
    return most


@pytest.mark.parametrize(("models", "together"), [
    ({"a": {"replicas": 3, "gpu": True}}, 1),  # one GPU: in turn
    ({"a": {"replicas": 2, "gpus": [0, 1], "gpu": True}}, 2),  # a GPU each: together
    ({"a": {"replicas": 2, "gpus": [0, 0], "gpu": True},
      "b": {"replicas": 1, "gpus": [0], "gpu": True}}, 1),  # two models on GPU 0
    ({"a": {"replicas": 2, "gpu": True, "pool-blocks": 512}}, 2),  # fixed pools
    ({"a": {"replicas": 3}}, 3),  # CPU runners
])
def test_the_supervisor_starts_gpu_runners_one_at_a_time_per_gpu(
        tmp_path, monkeypatch, models, together):
    monkeypatch.setattr(sup, "RunnerProcess", StandIn)
    monkeypatch.setattr(StandIn, "log", [])
    config = load_config({"models": {name: {"source": "x.gguf", **entry}
                                     for name, entry in models.items()}}, FLAGS)

    async def load_all() -> None:
        s = sup.Supervisor(config, tmp_path)
        try:
            await asyncio.gather(*(s.load(state) for state in s.models.values()))
            assert all(r.status == "ready" for state in s.models.values()
                       for r in state.replicas)
        finally:
            s._closing = True
            await s._http.aclose()

    asyncio.run(load_all())
    starts = sum(1 for event, _, _ in StandIn.log if event == "start")
    assert starts == sum(entry["replicas"] for entry in models.values())
    assert overlapping(StandIn.log) == together
