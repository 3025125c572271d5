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
