"""The GPU check's shell scripts, as far as a machine without a GPU can run them: both parse,
and a staging call takes in what it brought (gpu_pack.sh's folders) without starting a build
where there is no nvidia-smi. (GPU_CHECK_CPU=1 runs the whole check on a CPU; the README says
how long it takes.)"""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_pack.sh"])
def test_the_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_a_staging_call_takes_in_what_it_brought(tmp_path):
    repo, gpu = tmp_path / "repo", tmp_path / "gpu"
    (repo / ".gpu" / "base" / "whl").mkdir(parents=True)
    (repo / ".gpu" / "part2").mkdir()
    (repo / ".gpu" / "base" / "llama_cpp_python-0.3.36.tar.gz").write_bytes(b"sdist")
    (repo / ".gpu" / "base" / "whl" / "litestar-2.25.0-py3-none-any.whl").write_bytes(b"w")
    (repo / ".gpu" / "part2" / "demo_part2-1.0.0-py3-none-any.whl").write_bytes(b"p")
    env = {**os.environ, "GPU_DIR": str(gpu), "PATH": "/usr/bin:/bin"}  # no nvidia-smi
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--stage"],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("staged\n")  # no GPU here: no build started
    assert (gpu / "llama_cpp_python-0.3.36.tar.gz").read_bytes() == b"sdist"
    assert sorted(p.name for p in (gpu / "whl").iterdir()) == [
        "demo_part2-1.0.0-py3-none-any.whl", "litestar-2.25.0-py3-none-any.whl"]
    assert not (gpu / "build.started").exists()
