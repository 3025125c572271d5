"""The ports a local Ray head is given (cluster/local_ray.py): distinct, all of them. One at a
time, the kernel may hand the same free port out twice, and Ray then refuses to start ("the
same port is not used by multiple components"); a fresh-clone run hit that."""

import socket

from justllm.gateway.runner import free_ports


def test_free_ports_are_distinct_and_free():
    for _ in range(20):
        ports = free_ports(7)
        assert len(set(ports)) == 7
        for port in ports:  # each can be bound now
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_a_new_head_keeps_only_the_newest_earlier_logs(tmp_path):
    """Every local head wrote a log named by its port, and none was ever removed."""
    import os

    from justllm.cluster.local_ray import prune_logs

    for i in range(9):
        log = tmp_path / f"local-ray-{4000 + i}.log"
        log.write_text("x")
        os.utime(log, (1000 + i, 1000 + i))
    (tmp_path / "local-ray.json").write_text("{}")  # (not a log)
    prune_logs(tmp_path, keep=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "local-ray-4005.log", "local-ray-4006.log", "local-ray-4007.log", "local-ray-4008.log",
        "local-ray.json"]
