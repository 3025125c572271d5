"""What a failed ``justllm cluster deploy`` says and leaves, with Ray's calls faked: a real
failed deploy needs a fresh Ray head of its own (a minute here); the deploy itself is tested
on a real cluster in test_ray_cluster.py."""

from __future__ import annotations

import contextlib
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
    monkeypatch.setattr(d.serve, "status", lambda: SimpleNamespace(applications=dict(apps)))
    monkeypatch.setattr(d.serve, "delete", lambda name: apps.pop(name))
    return apps, done


def test_a_port_in_use_is_one_error_line(ray_faked, monkeypatch):
    """It was an 80-line traceback."""
    def refuse(**kwargs):
        raise RuntimeError("Failed to bind to address '127.0.0.1:8000'.")

    monkeypatch.setattr(d.serve, "start", refuse)
    with pytest.raises(JustLLMError, match=r"cannot listen on 127.0.0.1:8000: .*Failed to bind"):
        d.deploy(None, ClusterSettings(), None, d.Cluster(HEAD.address, HEAD))
    assert ray_faked[1] == ["head stopped"]  # the head this deploy started: nothing on it


@pytest.mark.parametrize("local, other_app", [(True, False), (True, True), (False, False)])
def test_a_failed_app_is_removed_only_when_it_is_all_there_is(ray_faked, monkeypatch, local,
                                                              other_app):
    """A failed deploy left the head it started running, with the failed app, unsaid."""
    apps, done = ray_faked
    if other_app:
        apps["other"] = "RUNNING"

    def fail(app, name, route_prefix):
        apps[name] = "DEPLOY_FAILED"
        raise RuntimeError("ModelLoadError: not a readable GGUF file")

    monkeypatch.setattr(d.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(d.serve, "run", fail)
    monkeypatch.setattr(d, "_why_failed", lambda app: "model-bad: ModelLoadError: not a GGUF")
    cluster = d.Cluster(HEAD.address, HEAD if local else None)
    with pytest.raises(JustLLMError) as e:
        d.deploy(None, ClusterSettings(), None, cluster)
    assert str(e.value).startswith("the deploy failed: model-bad: ModelLoadError")
    if local and not other_app:  # gone, head and all
        assert "justllm" not in apps and done == ["head stopped"]
        assert "stays" not in str(e.value)
    else:
        assert apps["justllm"] == "DEPLOY_FAILED" and done == []
        assert "'justllm cluster down --name justllm' removes it" in str(e.value)
