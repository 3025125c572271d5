"""llama.cpp's OpenMP threads sleep soon after a decode, so the step's rows can use their cores."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from justllm.engine import openmp
from justllm.engine.row_sampling import sampling_workers


@pytest.fixture
def maps(tmp_path):
    """A stand-in for /proc/self/maps without libgomp in it."""
    path = tmp_path / "maps"
    path.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
    return path


def test_the_spin_is_set_while_llama_cpp_loads_and_then_taken_back(monkeypatch, maps):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with openmp.short_spin(maps) as short:
        assert short and os.environ["GOMP_SPINCOUNT"] == str(openmp.SPIN_COUNT)
    assert "GOMP_SPINCOUNT" not in os.environ  # children inherit the environment as it was


def test_libgomp_loaded_before_keeps_its_own_spin(monkeypatch, maps):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libgomp.so.1\n")
    with openmp.short_spin(maps) as short:
        assert not short and "GOMP_SPINCOUNT" not in os.environ


@pytest.mark.parametrize("name,value,short", [
    ("GOMP_SPINCOUNT", "1000", True),
    ("GOMP_SPINCOUNT", "3k", True),
    ("GOMP_SPINCOUNT", "300000", False),
    ("GOMP_SPINCOUNT", "10k", False),
    ("GOMP_SPINCOUNT", "infinite", False),
    ("GOMP_SPINCOUNT", "lots", False),
    ("OMP_WAIT_POLICY", "PASSIVE", True),
    ("OMP_WAIT_POLICY", "active", False)])
def test_a_policy_of_the_users_own_is_kept_and_read(monkeypatch, maps, name, value, short):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv(name, value)
    with openmp.short_spin(maps) as got:
        assert got is short and os.environ[name] == value
    assert os.environ[name] == value


@pytest.mark.parametrize("cores_idle,cores,workers", [(True, 2, 2), (True, 16, 8),
                                                      (True, 1, 1), (False, 2, 1)])
def test_cores_llama_cpp_leaves_soon_take_the_rows_on_a_cpu_build(cores_idle, cores, workers):
    assert sampling_workers(False, 0, cores, cores_idle=cores_idle) == workers


SPIN_PROBE = textwrap.dedent("""
    import os, resource, sys, time
    os.sched_setaffinity(0, range(os.cpu_count()))  # (the suite pins each worker to a core)
    from justllm.engine.backend import cores_idle_between_decodes
    from justllm.engine.llm import LLM
    from justllm.core.sampling_params import SamplingParams
    llm = LLM(sys.argv[1], max_seqs=1, threads=2)
    llm.generate("The sea", SamplingParams(max_tokens=2))
    used = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    before = used()
    time.sleep(0.2)  # this thread sleeps: only llama.cpp's other thread can use a CPU now
    print(cores_idle_between_decodes(), os.environ.get("GOMP_SPINCOUNT"), used() - before)
""")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="llama.cpp needs two threads to spin")
def test_llama_cpps_second_thread_sleeps_soon_after_a_decode(model_path):
    """In a real process: with the count set as llama.cpp loads, its second OpenMP thread
    uses almost no CPU once a decode is over (0.13 ms measured); with libgomp's own kind of
    count it spins on (the control, 0.2 s measured: what the engine's rows would have fought
    for). On the CPU, even where the suite runs on a GPU: the threads in question are the CPU
    build's."""
    def probe(**env: str) -> tuple[str, str, float]:
        base = {k: v for k, v in os.environ.items() if k != "JUSTLLM_GPU"}
        out = subprocess.run([sys.executable, "-c", SPIN_PROBE, model_path], check=True,
                             capture_output=True, text=True, timeout=120,
                             env={**base, **env}).stdout.split()
        return out[0], out[1], float(out[2])

    idle, spin, cpu = probe()
    assert (idle, spin) == ("True", "None") and cpu < 0.02, cpu
    idle, spin, cpu = probe(GOMP_SPINCOUNT="1000000000")
    assert (idle, spin) == ("False", "1000000000") and cpu > 0.05, cpu
