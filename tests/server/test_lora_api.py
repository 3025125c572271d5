"""LoRA adapters through a real ``justllm serve`` and the real ``openai`` client.

Adapters are chosen as vLLM does (by name, as the ``model``) or with llama-server's per-request
``lora`` field; ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change them at run time
behind ``--enable-lora-runtime``; ``/metrics`` counts requests and tokens per adapter.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import openai
import pytest

from justllm.gateway.config import Flags, load_config
from tests.lora_files import write_adapter
from tests.server.conftest import start_server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-api")
    return {"a": write_adapter(d / "a.gguf", seed=1), "b": write_adapter(d / "b.gguf", seed=2),
            "c": write_adapter(d / "c.gguf", seed=3),
            "wrong": write_adapter(d / "wrong.gguf", seed=4, n_embd=512)}


@pytest.fixture(scope="module")
def lora_server(model_path, files):
    s = start_server(model_path, "--max-seqs", "8", "--pool-blocks", "256",
                     "--lora", f"a={files['a']}", "--lora", f"b={files['b']}:0.8",
                     "--enable-lora-runtime")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(lora_server):
    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def complete(client, model: str, lora: list | None = None, n: int = 8) -> str:
    extra = {"ignore_eos": True} | ({"lora": lora} if lora is not None else {})
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0,
                                  extra_body=extra)
    assert r.choices[0].finish_reason == "length"
    return r.choices[0].text


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=120)


def test_adapters_are_models_whose_parent_is_the_base(client, lora_server):
    cards = {m.id: m for m in client.models.list().data}
    base = lora_server.model
    assert list(cards) == [base, "a", "b"]
    assert cards["a"].parent == base and cards["b"].parent == base
    assert getattr(cards[base], "parent", None) is None
    listed = httpx.get(lora_server.url + "/v1/lora_adapters", timeout=30).json()
    assert [(x["id"], x["name"], x["scale"]) for x in listed] == [(0, "a", 1.0), (1, "b", 0.8)]


def test_an_adapter_is_chosen_by_model_name_or_by_the_lora_field(client, lora_server):
    base = complete(client, lora_server.model)
    a = complete(client, "a")
    assert a != base
    assert complete(client, lora_server.model, [{"name": "a"}]) == a
    assert complete(client, lora_server.model, [{"id": 0, "scale": 1.0}]) == a
    assert complete(client, "a", [{"name": "a", "scale": 0}]) == base  # rescaled to nothing
    assert complete(client, "b") == complete(client, lora_server.model, [{"id": 1}])
    chat = client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    assert chat.choices[0].message.content is not None
    # Answers name the model the request named: the adapter (as vLLM's), else the base.
    assert chat.model == "b"
    assert client.completions.create(model="a", prompt=PROMPT, max_tokens=1).model == "a"
    assert client.completions.create(model=lora_server.model, prompt=PROMPT, max_tokens=1,
                                     extra_body={"lora": [{"name": "a"}]}).model == \
        lora_server.model
    streamed = [c.model for c in client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True)]
    assert streamed and set(streamed) == {"a"}
    streamed = [c.model for c in client.completions.create(
        model="b", prompt=PROMPT, max_tokens=2, stream=True)]
    assert streamed and set(streamed) == {"b"}


def test_ollama_routes_take_an_adapter_as_a_model(client, lora_server, files):
    """As a model made with Ollama's ADAPTER: listed with the base as its parent_model, shown
    with an ADAPTER line, and generating under the adapter."""
    base, url = lora_server.model, lora_server.url

    def generate(model: str) -> dict:
        r = httpx.post(url + "/api/generate", timeout=120, json={
            "model": model, "prompt": PROMPT, "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0}})
        assert r.status_code == 200, r.text
        return r.json()

    a = generate("a")
    assert a["model"] == "a" and a["response"]
    assert complete(client, "a").startswith(a["response"])  # the adapter was applied
    assert generate("a:latest")["response"] == a["response"]
    assert generate(base)["response"] != a["response"]
    r = httpx.post(url + "/api/chat", timeout=120, json={
        "model": "b", "stream": False, "messages": [{"role": "user", "content": "Hi"}],
        "options": {"num_predict": 3}})
    assert r.status_code == 200 and r.json()["model"] == "b", r.text
    tags = {m["name"]: m for m in httpx.get(url + "/api/tags", timeout=30).json()["models"]}
    assert list(tags) == [f"{base}:latest", "a:latest", "b:latest"]
    assert tags["a:latest"]["details"]["parent_model"] == f"{base}:latest"
    assert tags["a:latest"]["size"] == files["a"].stat().st_size
    assert tags["a:latest"]["digest"] != tags["b:latest"]["digest"] != tags[f"{base}:latest"]
    ps = httpx.get(url + "/api/ps", timeout=30).json()["models"]
    assert [m["name"] for m in ps] == list(tags)
    shown = httpx.post(url + "/api/show", json={"model": "a"}, timeout=30).json()
    assert shown["details"]["parent_model"] == f"{base}:latest"
    assert f"ADAPTER {files['a']}" in shown["modelfile"]
    assert "ADAPTER" not in httpx.post(url + "/api/show", json={"model": base},
                                       timeout=30).json()["modelfile"]
    r = httpx.post(url + "/api/embed", json={"model": "a", "input": "x"}, timeout=30)
    assert r.status_code == 400 and f"send model '{base}'" in r.json()["error"], r.text
    r = httpx.post(url + "/v1/embeddings", json={"model": "a", "input": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert f"send model '{base}'" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/api/generate", json={"model": "zz", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and 'model "zz" not found' in r.json()["error"], r.text


@pytest.mark.parametrize("model, lora, status, words", [
    ("zz", None, 404, "the model 'zz' does not exist"),
    (None, [{"id": 9}], 400, "lora[0]: no LoRA adapter with id 9"),
    (None, [{"name": "a", "id": 0}], 400, "give an adapter's id or its name"),
    (None, [{"name": "a", "scale": 1e9}], 400, "lora scales"),
])
def test_bad_adapter_choices(lora_server, model, lora, status, words):
    body = {"model": model or lora_server.model, "prompt": PROMPT, "max_tokens": 2}
    if lora is not None:
        body["lora"] = lora
    r = post(lora_server, "completions", body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_per_adapter_metrics(client, lora_server):
    complete(client, "a", n=3)
    text = httpx.get(lora_server.url + "/metrics", timeout=30).text
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
             if ln.startswith("justllm_lora")}
    model = lora_server.model
    assert lines[f'justllm_lora_requests_total{{lora_name="a",model_name="{model}"}}'] >= 1
    assert lines[f'justllm_lora_generation_tokens_total{{lora_name="a",model_name="{model}"}}'] \
        >= 3
    assert lines[f'justllm_lora_switches_total{{model_name="{model}"}}'] >= 1
    assert lines[f'justllm_lora_adapters{{model_name="{model}"}}'] >= 2


def test_runtime_load_and_refusals(client, lora_server, files):
    r = post(lora_server, "load_lora_adapter", {"lora_name": "c", "lora_path": str(files["c"])})
    assert r.status_code == 200 and "added successfully" in r.text
    assert "c" in [m.id for m in client.models.list().data]
    assert complete(client, "c") not in (complete(client, "a"),
                                         complete(client, lora_server.model))
    for body, words in [
        ({"lora_name": "c", "lora_path": str(files["c"])}, "is loaded already"),
        ({"lora_name": "w", "lora_path": str(files["wrong"])}, "incorrect shape"),
        ({"lora_name": "n", "lora_path": "/nonexistent.gguf"}, "file not found"),
        # (each said "file not found", the empty one for ".")
        ({"lora_name": "n", "lora_path": "/tmp"}, "/tmp: a directory, not a file"),
        ({"lora_name": "n", "lora_path": "/dev/zero"}, "/dev/zero: not a regular file"),
        ({"lora_name": "n", "lora_path": ""}, "a LoRA adapter's path is empty"),
        ({"lora_name": lora_server.model, "lora_path": str(files["c"])}, "base model's name"),
        ({"lora_name": "bad name", "lora_path": str(files["c"])}, "use letters"),
    ]:
        r = post(lora_server, "load_lora_adapter", body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = post(lora_server, "unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404

    # load_inplace: a file that fails its checks leaves the adapter it was to replace loaded;
    # a good one takes its place.
    before = complete(client, "c")
    r = post(lora_server, "load_lora_adapter", {"lora_name": "c", "load_inplace": True,
                                                "lora_path": str(files["wrong"])})
    assert r.status_code == 400 and "incorrect shape" in r.text, r.text
    assert complete(client, "c") == before
    r = post(lora_server, "load_lora_adapter", {"lora_name": "c", "load_inplace": True,
                                                "lora_path": str(files["b"])})
    assert r.status_code == 200, r.text
    paths = {a["name"]: a["path"] for a in httpx.get(f"{lora_server.url}/v1/lora_adapters",
                                                    timeout=30).json()}
    assert paths["c"] == str(files["b"]) and complete(client, "c") != before


def test_unloading_waits_for_the_adapters_requests(lora_server, files):
    """A streaming request under the adapter runs to its end while the unload waits; requests
    for the adapter are refused from the moment the unload starts."""
    post(lora_server, "load_lora_adapter", {"lora_name": "d", "lora_path": str(files["c"])})

    async def scenario() -> tuple[int, list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=lora_server.url + "/v1", timeout=120) as http:
            body = {"model": "d", "prompt": PROMPT, "max_tokens": 60, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/completions", json=body) as stream:
                events = stream.aiter_lines()
                first = await anext(events)
                assert first.startswith("data: ")
                unload = asyncio.create_task(http.post("/unload_lora_adapter",
                                                       json={"lora_name": "d"}))
                refused = None
                while refused is None:  # the unload has begun once "d" is gone from the list
                    await asyncio.sleep(0.01)
                    ids = [m["id"] for m in (await http.get("/models")).json()["data"]]
                    if "d" not in ids:
                        refused = (await http.post("/completions", json={
                            "model": "d", "prompt": PROMPT, "max_tokens": 2})).status_code
                rest = [line async for line in events if line.startswith("data: ")]
            return refused, [first] + rest, await unload

    refused, events, unloaded = asyncio.run(scenario())
    assert refused == 404
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2].replace(" ", "")  # ran to max_tokens
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    r = post(lora_server, "completions", {"model": "d", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404


def test_runtime_routes_are_off_without_the_flag(server, files):
    r = post(server, "load_lora_adapter", {"lora_name": "c", "lora_path": str(files["c"])})
    assert r.status_code == 404 and "--enable-lora-runtime" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/lora_adapters", timeout=30).json() == []


def test_models_yaml_passes_adapters_to_the_runner():
    flags = Flags(frozenset({"lora", "max-seqs", "enable-lora-runtime"}),
                  switches=frozenset({"enable-lora-runtime"}))
    config = load_config({"models": {
        "chat": {"source": "m.gguf", "lora": ["a=/x/a.gguf", "b=/x/b.gguf:0.5"],
                 "enable-lora-runtime": True},
        "other": {"source": "m.gguf", "lora": {"c": "/x/c.gguf"}}}}, flags)
    assert config.spec("chat").runner_args() == [
        "--enable-lora-runtime", "--lora", "a=/x/a.gguf", "--lora", "b=/x/b.gguf:0.5"]
    assert config.spec("other").runner_args() == ["--lora", "c=/x/c.gguf"]
    with pytest.raises(ValueError, match="lora must be NAME=PATH"):
        load_config({"models": {"x": {"source": "m.gguf", "lora": [3]}}}, flags)
    # Router mode: an adapter's name is a model name the gateway routes to its base model
    # (and passes on unchanged, so the runner applies the adapter); names never clash.
    assert config.spec("chat").adapters == ("a", "b") and config.names["b"] == "chat"
    assert config.names["c"] == "other"
    with pytest.raises(ValueError, match="'chat' is used twice"):
        load_config({"models": {"chat": {"source": "m.gguf"},
                                "x": {"source": "m.gguf", "lora": ["chat=/x/a.gguf"]}}}, flags)


def test_an_adapter_named_as_the_base_model_is_refused_at_start(model_path, files):
    """It hid the base model: a request for the base model's name got the adapter."""
    r = subprocess.run([sys.executable, "-m", "justllm", "serve", model_path,
                        "--served-model-name", "demo", "--lora", f"demo={files['c']}",
                        "--port", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == ("error: --lora demo=…: 'demo' is the base model's name; give "
                                "the adapter another")


def test_llama_servers_global_scales(client, lora_server, files):
    """llama-server's GET/POST /lora-adapters: the adapters a request that chooses none runs
    under, on every route; a choice (model or lora field) overrides them; none by default."""
    url, base = lora_server.url, lora_server.model

    def scales() -> dict[str, float]:
        listed = httpx.get(url + "/lora-adapters", timeout=30).json()
        return {a["name"]: a["scale"] for a in listed if a["name"] in ("a", "b", "d")}

    def native(**body) -> dict:
        r = httpx.post(url + "/completion", timeout=120, json={
            "prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True, **body})
        assert r.status_code == 200, r.text
        return r.json()

    def ollama(model: str) -> str:
        return httpx.post(url + "/api/generate", timeout=120, json={
            "model": model, "prompt": PROMPT, "stream": False, "raw": True,
            "options": {"temperature": 0, "num_predict": 6}}).json()["response"]

    def set_scales(body) -> httpx.Response:
        return httpx.post(url + "/lora-adapters", json=body, timeout=30)

    plain, with_a, with_b = complete(client, base), complete(client, "a"), complete(client, "b")
    assert scales() == {"a": 0.0, "b": 0.0}  # not applied unless asked
    assert native()["content"] == plain and native()["generation_settings"]["lora"] == []
    ollama_a = ollama("a")
    try:
        r = set_scales([{"id": 0, "scale": 1.0}])
        assert r.status_code == 200 and r.json() == {"success": True}, r.text
        assert scales() == {"a": 1.0, "b": 0.0}
        assert complete(client, base) == with_a  # a request that chooses none
        assert native()["content"] == with_a
        assert native()["generation_settings"]["lora"] == [{"id": 0, "scale": 1.0}]
        assert ollama(base) == ollama_a
        # a choice replaces them: by model, by the lora field (here on /completion too)
        assert complete(client, "b") == with_b
        assert complete(client, base, [{"name": "b"}]) == with_b
        assert native(lora=[{"id": 1}])["content"] == with_b
        assert native(lora=[{"name": "b", "scale": 0.8}])["generation_settings"]["lora"] == [
            {"id": 1, "scale": 0.8}]
        for body, param in [([{"id": 9, "scale": 1.0}], "[0]"), ([{"name": "a"}], "scale"),
                            ([{"scale": 1.0}], "[0]"), ({"id": 0, "scale": 1.0}, None),
                            ([{"id": 0, "scale": 1.0, "x": 1}], "x"),
                            ([{"id": 0, "scale": 1e9}], "[0].scale")]:
            r = set_scales(body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert param is None or param in error["message"] + (error["param"] or ""), r.text
        assert scales() == {"a": 1.0, "b": 0.0}  # a refused POST changes nothing
        # an adapter unloaded leaves them; one loaded again under its name starts off
        r = post(lora_server, "load_lora_adapter", {"lora_name": "d",
                                                    "lora_path": str(files["c"])})
        assert r.status_code == 200, r.text
        assert set_scales([{"name": "d", "scale": 1.0}]).status_code == 200
        assert scales() == {"a": 0.0, "b": 0.0, "d": 1.0}  # the others not applied now
        with_d = complete(client, base)
        assert with_d not in (plain, with_a)
        assert post(lora_server, "unload_lora_adapter", {"lora_name": "d"}).status_code == 200
        assert complete(client, base) == plain
        assert post(lora_server, "load_lora_adapter", {"lora_name": "d",
                                                       "lora_path": str(files["c"])}
                    ).status_code == 200
        assert scales()["d"] == 0.0 and complete(client, base) == plain
        assert post(lora_server, "unload_lora_adapter", {"lora_name": "d"}).status_code == 200
    finally:
        set_scales([])
    assert scales() == {"a": 0.0, "b": 0.0} and complete(client, base) == plain


def test_unload_checks_lora_int_id_against_the_adapters_id(lora_server, files):
    """vLLM's lora_int_id was taken and never read: an id naming another adapter unloaded the
    named one all the same."""
    r = post(lora_server, "load_lora_adapter", {"lora_name": "e", "lora_path": str(files["c"])})
    assert r.status_code == 200, r.text

    def ids() -> dict[str, int]:
        return {a["name"]: a["id"] for a in httpx.get(f"{lora_server.url}/v1/lora_adapters",
                                                      timeout=30).json()}

    e = ids()["e"]
    for other in (ids()["a"], e + 1000):
        r = post(lora_server, "unload_lora_adapter", {"lora_name": "e", "lora_int_id": other})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "lora_int_id" and error["message"] == (
            f"lora_int_id {other} is not the id of the LoRA adapter 'e' (its id is {e}: see GET "
            "/v1/lora_adapters); leave it out to unload by name")
    r = post(lora_server, "unload_lora_adapter", {"lora_name": "e", "lora_int_id": "1"})
    assert r.status_code == 400 and "lora_int_id" in r.text, r.text
    assert "e" in ids()  # refused: still loaded
    r = post(lora_server, "unload_lora_adapter", {"lora_name": "e", "lora_int_id": e})
    assert r.status_code == 200 and "removed successfully" in r.text, r.text
    assert "e" not in ids()
