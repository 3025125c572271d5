"""The gateway's pure decisions and its configuration (no processes)."""

from __future__ import annotations

import logging
import math
import os

import pytest

from justllm.gateway.config import Flags, directory_config, list_config, load_config
from justllm.gateway.policy import (
    MAX_FAILURES,
    Loaded,
    expired,
    lora_request,
    parse_size,
    restart_delay,
    session_key,
    to_unload_for,
)
from justllm.server.ollama import keep_alive_seconds

FLAGS = Flags(frozenset({"max-seqs", "ctx", "gpu", "pool-blocks", "lora", "spec", "draft-model",
                         "chat-template"}), {"ctx": 512}, switches=frozenset({"gpu"}))
INF, NAN = math.inf, math.nan  # YAML's .inf and .nan


def test_expired_only_idle_models_past_their_ttl():
    models = [Loaded("a", 0, 100.0, 10), Loaded("b", 1, 0.0, 10), Loaded("c", 0, 0.0, -1),
              Loaded("d", 0, 105.0, 10), Loaded("e", 0, 110.0, 0)]
    assert expired(models, 110.0) == ["a", "e"]


def test_room_is_made_by_unloading_the_least_recently_used_idle_models():
    models = [Loaded("a", 0, 5.0, 60), Loaded("b", 0, 1.0, 60), Loaded("c", 2, 0.0, 60)]
    assert to_unload_for(models, 0) == []
    assert to_unload_for(models, 4) == []
    assert to_unload_for(models, 3) == ["b"]
    assert to_unload_for(models, 2) == ["b", "a"]
    assert to_unload_for(models, 1) is None  # "c" is busy: wait for it


def test_room_by_memory_too():
    gib = 2**30
    models = [Loaded("a", 0, 1.0, 60, 2 * gib), Loaded("b", 0, 2.0, 60, 3 * gib),
              Loaded("c", 1, 0.0, 60, 1 * gib)]
    assert to_unload_for(models, 0, max_memory=8 * gib, need=2 * gib) == []
    assert to_unload_for(models, 0, max_memory=8 * gib, need=3 * gib) == ["a"]
    assert to_unload_for(models, 0, max_memory=8 * gib, need=6 * gib) == ["a", "b"]
    assert to_unload_for(models, 0, max_memory=8 * gib, need=8 * gib) is None  # c is busy
    assert to_unload_for(models, 3, max_memory=8 * gib, need=gib) == ["a"]  # the count


def test_memory_estimate_of_the_demo_model_is_close_to_what_a_runner_uses(model_path,
                                                                          monkeypatch):
    from justllm.gateway.config import ModelSpec
    from justllm.gateway.memory import runner_memory

    # (a gateway under JUSTLLM_GPU=1 counted a CPU runner's pool as the GPU default's, 0
    # blocks: a runner's device is its own flag's)
    monkeypatch.setenv("JUSTLLM_GPU", "1")

    default = runner_memory(ModelSpec("demo", model_path))
    small = runner_memory(ModelSpec("demo", model_path, flags=(("pool-blocks", 64),)))
    # A default runner's RSS measured ~900 MiB (benchmarks/reliability_soak.py).
    assert 700 * 2**20 < default < 1100 * 2**20
    # 960 blocks x 16 tokens x 18 layers x 1 KV head x (256 + 256) x 2 bytes less KV
    assert default - small == 960 * 16 * 18 * 512 * 2
    # A --gpu runner's KV cache is in VRAM: none of it counts against max-memory.
    gpu = runner_memory(ModelSpec("demo", model_path, flags=(("gpu", True),)))
    assert default - gpu == 1024 * 16 * 18 * 512 * 2


@pytest.mark.parametrize("value, size", [("8GB", 8 * 10**9), ("512MiB", 512 * 2**20),
                                         ("1.5G", 1_500_000_000), (4096, 4096)])
def test_sizes(value, size):
    assert parse_size(value) == size


@pytest.mark.parametrize("value", [INF, "9" * 400])
def test_sizes_too_large_for_an_integer(value):
    """(int(inf) raised OverflowError: a traceback from `justllm serve --models`.)"""
    with pytest.raises(ValueError, match="size"):
        parse_size(value)


def test_restart_backoff_then_failed():
    delays = [restart_delay(n) for n in range(MAX_FAILURES + 1)]
    assert delays[0] == 0.0 and delays[1] < delays[2] and delays[-1] is None


@pytest.mark.parametrize("value, seconds", [(0, 0.0), (-1, -1.0), (30, 30.0), ("5m", 300.0),
                                            ("1h", 3600.0), ("10s", 10.0), ("250ms", 0.25),
                                            ("-1", -1.0), ("1h30m", 5400.0)])
def test_keep_alive_as_ollama_reads_it(value, seconds):
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", True, None, [1], "5 days"])
def test_bad_keep_alive(value):
    with pytest.raises(ValueError):
        keep_alive_seconds(value)


def test_preloads_up_to_max_loaded_and_remote_ones_besides():
    cfg = load_config({"max-loaded": 1, "models": {
        "a": {"source": "/a", "preload": True},
        "far": {"source": "/f", "preload": True, "urls": ["http://10.0.0.7:8080"],
                "replicas": 0},
        "b": "/b"}}, FLAGS)
    assert [m.name for m in cfg.models if m.preload] == ["a", "far"]


def test_config_from_yaml_data():
    cfg = load_config({"max-loaded": 1, "models": {
        "chat": {"source": "/m.gguf", "aliases": ["gpt-4o-mini"], "ttl": 5, "max-seqs": 4,
                 "gpu": True},
        "coder": "/c.gguf"}}, FLAGS)
    chat = cfg.spec("chat")
    assert cfg.max_loaded == 1 and cfg.names["gpt-4o-mini"] == "chat"
    assert chat.runner_args() == ["--ctx", "512", "--gpu", "--max-seqs", "4"]
    assert cfg.spec("coder").ttl == 300 and cfg.spec("coder").runner_args() == ["--ctx", "512"]
    lora = load_config({"models": {"a": {"source": "/a", "lora": [
        "sql=/l/sql.gguf", "py=/l/a:b.gguf:0.5"]}}}, FLAGS).spec("a")
    assert lora.adapters == ("sql", "py")
    assert [(a.name, a.path, a.scale) for a in lora.lora_specs] == [
        ("sql", "/l/sql.gguf", 1.0), ("py", "/l/a:b.gguf", 0.5)]


def test_a_models_api_key_goes_to_its_urls_only_and_stays_out_of_its_repr(monkeypatch):
    from justllm.gateway.supervisor import remote_key

    monkeypatch.setenv("JUSTLLM_TEST_KEY", "from-env")
    cfg = load_config({"models": {
        "a": {"urls": ["http://h:1", "http://h:2/"], "api-key": "${JUSTLLM_TEST_KEY}"},
        "b": {"prefill-replicas": ["http://p:1"], "decode-replicas": ["http://d:1"],
              "api-key": "plain"},
        "c": {"urls": ["http://h:3"]}}}, FLAGS)
    assert remote_key(cfg, "http://h:2/v1/completions") == "from-env"
    assert remote_key(cfg, "http://d:1/metrics") == remote_key(cfg, "http://p:1") == "plain"
    assert remote_key(cfg, "http://h:3/v1") is None  # no key: nothing is sent
    assert remote_key(cfg, "http://h:10/v1") is None  # not a url of a (prefix match)
    assert "from-env" not in repr(cfg.spec("a"))


@pytest.mark.parametrize("data, says", [
    ({"models": {}}, "at least one model"),
    ({"models": {"a": {"aliases": ["x"]}}}, "needs a 'source'"),
    ({"models": {"a": {"source": "/a", "max_seq": 3}}}, "unknown key(s) max_seq"),
    ({"models": {"a": "/a", "b": {"source": "/b", "aliases": ["a"]}}}, "used twice"),
    ({"models": {"a": {"source": "/a", "ttl": "long"}}}, "ttl must be a number"),
    ({"models": {"a": "/a"}, "max-memory": "lots"}, "max-memory"),
    ({"models": {"a": "/a"}, "max-models": 2}, "unknown key(s) max-models"),
    # each rule alone (one line said all five whichever was broken)
    ({"models": {"a": "/a"}, "max-loaded": -1}, "max-loaded must be >= 0"),
    # (the preloads unloaded one another at start, the last one left)
    ({"max-loaded": 1, "models": {"a": {"source": "/a", "preload": True},
                                  "b": {"source": "/b", "min-replicas": 1, "max-replicas": 2}}},
     "2 models preload (a, b (min-replicas >= 1)) but max-loaded is 1: they would unload one "
     "another as the gateway starts; preload at most 1, or raise max-loaded"),
    ({"models": {"a": "/a"}, "load-timeout": 0}, "load-timeout must be > 0 seconds"),
    ({"models": {"a": "/a"}, "health-timeout": 0}, "health-timeout must be >= 1 second"),
    ([1, 2], "must be a mapping"),
    ({"models": {"a": {"source": "/a", "api-key": "k"}}}, "api-key is the key of the model's urls"),
    ({"models": {"a": {"urls": ["http://h:1"], "api-key": 5}}}, "api-key must be a string"),
    ({"models": {"a": {"urls": ["http://h:1"], "api-key": "${JUSTLLM_TEST_UNSET}"}}},
     "names the environment variable JUSTLLM_TEST_UNSET, which is not set"),
    # an adapter's name or scale when models.yaml is read, not from each replica as it starts
    ({"models": {"a": {"source": "/a", "lora": ["bad name=/l.gguf"]}}},
     "model 'a': LoRA adapter name 'bad name'"),
    ({"models": {"a": {"source": "/a", "lora": {"sql": "/l.gguf:1e9"}}}},
     "model 'a': LoRA adapter 'sql': scale must be a number"),
    # YAML's .inf and .nan: a traceback (OverflowError), or let through by every "<= 0"
    # check to fail the running gateway (a 500 on each request, the autoscaler's loop dead)
    ({"models": {"a": "/a"}, "max-loaded": INF}, "max-loaded must be an integer (got inf)"),
    ({"models": {"a": "/a"}, "max-loaded": NAN}, "max-loaded must be an integer (got nan)"),
    ({"models": {"a": "/a"}, "max-waiting": INF}, "max-waiting must be an integer (got inf)"),
    ({"models": {"a": "/a"}, "max-memory": INF}, "max-memory: inf is not a size"),
    ({"models": {"a": "/a"}, "load-timeout": NAN},
     "load-timeout must be a finite number (got nan)"),
    ({"models": {"a": "/a"}, "load-timeout": INF},
     "load-timeout must be a finite number (got inf)"),
    ({"models": {"a": "/a"}, "health-timeout": NAN},
     "health-timeout must be a finite number (got nan)"),
    ({"models": {"a": "/a"}, "poll-interval": NAN},
     "poll-interval must be a finite number (got nan)"),
    ({"models": {"a": {"source": "/a", "ttl": NAN}}},
     "model 'a': ttl must be a finite number (got nan)"),
    ({"models": {"a": {"source": "/a", "max-replicas": 2, "target-ongoing": NAN}}},
     "model 'a': target-ongoing must be a finite number (got nan)"),
    ({"models": {"a": {"source": "/a", "max-replicas": 2, "upscale-delay": INF}}},
     "model 'a': upscale-delay must be a finite number (got inf)"),
    ({"models": {"a": {"source": "/a", "prefill-replicas": 1,
                       "decode-replicas": {"max-replicas": 2, "downscale-delay": NAN}}}},
     "model 'a': decode-replicas: downscale-delay must be a finite number (got nan)"),
    # a count is an integer (1.7 became 1)
    ({"models": {"a": "/a"}, "max-loaded": 1.7}, "max-loaded must be an integer (got 1.7)"),
    ({"models": {"a": "/a"}, "max-waiting": "8"}, "max-waiting must be an integer (got '8')"),
    # ignored: a bare number, an empty string (any falsy value was "none")
    ({"models": {"a": {"source": "/a", "gpus": 0}}},
     "model 'a': gpus must be a list of device numbers such as [0, 1] (got 0)"),
    ({"models": {"a": {"source": "/a", "gpus": ""}}}, "gpus must be a list of device numbers"),
    ({"models": {"a": {"source": "/a", "aliases": 0}}}, "model 'a': aliases must be names"),
    # (served, as a model's name with them is not)
    ({"models": {"a": {"source": "/a", "aliases": [" x"]}}},
     "model 'a': alias ' x' has spaces at an end or a control character"),
    ({"models": {"a": {"source": "/a", "aliases": ["z\n"]}}},
     "model 'a': alias 'z\\n' has spaces at an end or a control character"),
    # (0.5 became 0 bytes: no limit)
    ({"models": {"a": "/a"}, "max-memory": 0.5}, "max-memory: 0.5 is not a whole number of "
                                                 "bytes"),
    # one server, twice (the check ran before the trailing / was taken off)
    ({"models": {"a": {"urls": ["http://h:1", "http://h:1/"]}}},
     "model 'a': a url is listed twice"),
    # served as '' (its runner log named .log), as "None", as "True"
    ({"models": {"": "/a"}}, "a model's name is empty ('')"),
    ({"models": {" ": "/a"}}, "a model's name is empty (' ')"),
    # a newline broke `justllm ps`'s rows; x@1 shared replica 1 of x's log file
    ({"models": {"nl\nname": "/a"}}, "model name 'nl\\nname' has spaces at an end or a "
     "control character"),
    ({"models": {" a": "/a"}}, "model name ' a' has spaces at an end"),
    ({"models": {"x@1": "/a"}}, "model name 'x@1': '@' marks a replica"),
    ({"models": {None: "/a"}}, "models.yaml: a model's name is ~ (null): give it a name"),
    ({"models": {True: "/a"}}, "models.yaml: a model is named true, which is how YAML reads"),
    # the runner refuses them: three failed starts and a 503 at the first request
    ({"models": {"a": {"source": "/a", "spec": "bogus"}}},
     "model 'a': spec must be one of ngram, draft, tree (got 'bogus')"),
    ({"models": {"a": {"source": "/a", "spec": "draft"}}},
     "model 'a': --spec draft needs --draft-model"),
    ({"models": {"a": {"source": "/a", "spec": "ngram", "draft-model": "/d.gguf"}}},
     "model 'a': --draft-model is for a method that drafts with it"),
    ({"models": {"a": {"source": "/a", "chat-template": ""}}},
     "model 'a': chat-template must be a template name or a file path"),
    ({"models": {"a": {"source": "/a", "spec": None}}}, "model 'a': spec must be a value"),
    # accepted, and sent to no runner: a model whose replicas are all urls starts none
    ({"models": {"a": {"urls": ["http://h:1"], "max-seqs": 4, "ctx": 64}}},
     "model 'a': ctx, max-seqs: engine flags of local replicas, and this model's replicas are "
     "all urls"),
    ({"models": {"a": {"prefill-replicas": ["http://h:1"], "decode-replicas": ["http://h:2"],
                       "gpu": True}}}, "model 'a': gpu: engine flags of local replicas"),
])
def test_config_errors_say_what_is_wrong(data, says):
    with pytest.raises(ValueError) as e:
        load_config(data, FLAGS)
    assert says in str(e.value)


def test_an_autoscaler_error_names_its_model_once():
    """It said "model 'a': model 'a': upscale-delay must be a number"."""
    for scaled, says in (({"max-replicas": 2, "upscale-delay": "30s"},
                          "model 'a': upscale-delay must be a number (got '30s')"),
                         ({"max-replicas": 2, "target-ongoing": 0},
                          "model 'a': target-ongoing must be > 0")):
        with pytest.raises(ValueError) as e:
            load_config({"models": {"a": {"source": "/a", **scaled}}}, FLAGS)
        assert str(e.value).startswith(says) and str(e.value).count("model 'a'") == 1


def test_the_configs_own_checks_refuse_nan_and_inf():
    """The checks of the configs themselves, which a NaN passed ("nan <= 0" is false)."""
    from justllm.gateway.autoscale import AutoscaleConfig
    from justllm.gateway.config import GatewayConfig, ModelSpec

    for options in ({"target_ongoing": NAN}, {"target_ongoing": INF}, {"upscale_delay": NAN},
                    {"downscale_delay": INF}):
        with pytest.raises(ValueError, match="target-ongoing must be > 0"):
            AutoscaleConfig(1, 2, **options)
    models = (ModelSpec("a", "/a"),)
    for options, says in (({"load_timeout": NAN}, "load-timeout"),
                          ({"health_timeout": NAN}, "health-timeout"),
                          ({"max_loaded": NAN}, "max-loaded")):
        with pytest.raises(ValueError, match=says):
            GatewayConfig(models, **options)


def test_spec_is_checked_as_serve_checks_it():
    """``spec`` among the gateway's methods (a plugin's too); a draft model alone means
    ``spec: draft``. (A chat template's file: tests/gateway/test_config_checks.py.)"""
    from justllm.spec.methods import SPEC_METHODS

    cfg = load_config({"models": {
        "a": {"source": "/a", "spec": "ngram"},
        "b": {"source": "/b", "draft-model": "/d.gguf"},
        "c": {"source": "/c", "spec": "tree", "draft-model": "/d.gguf"}}}, FLAGS)
    assert cfg.spec("a").runner_args() == ["--ctx", "512", "--spec", "ngram"]
    assert "--spec" not in cfg.spec("b").runner_args()  # the runner makes it draft too
    # The gateway's own --spec reaches every model, and is checked in each.
    with pytest.raises(ValueError, match="model 'x': spec must be one of"):
        list_config(["/m/x.gguf"], Flags(FLAGS.names, {"spec": "bogus"}))
    # A plugin's method is one; the methods are the Flags' (serve passes the plugins').
    mine = Flags(FLAGS.names, spec_methods={**SPEC_METHODS, "mine": SPEC_METHODS["ngram"]})
    assert load_config({"models": {"a": {"source": "/a", "spec": "mine"}}},
                       mine).spec("a").runner_args() == ["--spec", "mine"]


def test_gpus_and_urls_as_given():
    cfg = load_config({"models": {"a": {"source": "/a", "gpus": [0], "replicas": 2},
                                  "b": {"urls": "http://h:1/", "aliases": "bee"}}}, FLAGS)
    assert cfg.spec("a").gpus == (0,) and cfg.spec("a").gpu_of(1) == 0
    assert cfg.spec("b").urls == ("http://h:1",) and cfg.names["bee"] == "b"
    # A urls-only model's adapters are names the gateway routes (the gateway's own flags,
    # FLAGS' ctx here, are for the models it runs, and no error beside urls).
    cfg = load_config({"models": {"b": {"urls": "http://h:1", "lora": ["sql=/l.gguf"],
                                        "enable-lora-runtime": True}}},
                      Flags(FLAGS.names | {"enable-lora-runtime"}, {"ctx": 512},
                            switches=FLAGS.switches | {"enable-lora-runtime"}))
    assert cfg.names["sql"] == "b" and cfg.spec("b").lora_runtime
    assert load_config({"models": {1: "/a"}}, FLAGS).models[0].name == "1"  # (YAML's 1:)


def test_models_dir_names_models_by_file_stem(tmp_path, caplog):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "sub" / "b.gguf").write_bytes(b"x")
    (tmp_path / "rev2").mkdir()
    (tmp_path / "rev2" / "a.gguf").write_bytes(b"x")
    os.utime(tmp_path / "a.gguf", (1, 1))  # the top-level a.gguf is the older revision
    with caplog.at_level(logging.WARNING, logger="justllm.gateway.config"):
        cfg = directory_config(str(tmp_path), FLAGS)
    assert [m.name for m in cfg.models] == ["a", "b"]
    assert cfg.spec("a").source == str(tmp_path / "rev2" / "a.gguf")
    # the older one is said (it was left out in silence)
    assert f"{tmp_path / 'a.gguf'}: left out, model a is the newer " \
        f"{tmp_path / 'rev2' / 'a.gguf'}" in caplog.text
    # a file whose stem no model may be named is left out alone (it stopped the start)
    (tmp_path / "m@1.gguf").write_bytes(b"x")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="justllm.gateway.config"):
        assert [m.name for m in directory_config(str(tmp_path), FLAGS).models] == ["a", "b"]
    assert "m@1.gguf: left out ('@' marks a replica" in caplog.text
    (tmp_path / "m@1.gguf").unlink()
    at = tmp_path / "at"  # a split model's parts too (they were "later parts without a first")
    at.mkdir()
    for part in (1, 2):
        (at / f"b@2-0000{part}-of-00002.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="no model in .*: every .gguf there was left out"):
        directory_config(str(at), FLAGS)
    # A split model is one model, from its first part; a capitalised suffix is a GGUF too.
    for part in (1, 2, 3):
        (tmp_path / "sub" / f"big-0000{part}-of-00003.gguf").write_bytes(b"x")
    (tmp_path / "LOUD.GGUF").write_bytes(b"x")
    cfg = directory_config(str(tmp_path), FLAGS)
    assert [m.name for m in cfg.models] == ["LOUD", "a", "b", "big"]
    assert cfg.spec("big").source == str(tmp_path / "sub" / "big-00001-of-00003.gguf")
    # A link to nothing is left out, and said.
    (tmp_path / "gone.gguf").symlink_to(tmp_path / "moved" / "gone.gguf")
    with caplog.at_level(logging.WARNING, logger="justllm.gateway.config"):
        cfg = directory_config(str(tmp_path), FLAGS)
    assert "gone" not in [m.name for m in cfg.models]
    assert f"{tmp_path / 'gone.gguf'} is a link to {tmp_path / 'moved' / 'gone.gguf'}, which " \
        "does not exist" in caplog.text
    with pytest.raises(ValueError, match="not a directory"):
        directory_config(str(tmp_path / "none"), FLAGS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .gguf"):
        directory_config(str(tmp_path / "empty"), FLAGS)
    # A split model's later parts without its first: left out, and said (it was silent, and
    # alone it was "the gateway needs at least one model").
    (tmp_path / "sub" / "big-00001-of-00003.gguf").unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="justllm.gateway.config"):
        cfg = directory_config(str(tmp_path), FLAGS)
    assert "big" not in [m.name for m in cfg.models]
    assert "big-00002-of-00003.gguf is a later part of a split model whose first part " \
        "(big-00001-of-...) is not there: left out" in caplog.text
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "x-00002-of-00002.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"no model in .*parts: x-00002-of-00002.gguf is a "
                                         r"later part of a split model"):
        directory_config(str(tmp_path / "parts"), FLAGS)


def test_models_on_the_command_line_are_named_by_stem_or_ref():
    cfg = list_config(["/m/qwen-q4.gguf", "llama3:8b", "org/repo:file.gguf"], FLAGS)
    assert [m.name for m in cfg.models] == ["qwen-q4", "llama3:8b", "file"]
    with pytest.raises(ValueError, match="used twice"):
        list_config(["/a/x.gguf", "/b/x.gguf"], FLAGS)
    # A plugin's model answers to the name its source gives it, as a single serve of it does
    # (router mode served ollama:gemma3:270m as "ollama:gemma3:270m")
    ollama = {"ollama:gemma3:270m": "gemma3:270m"}.get
    cfg = list_config(["ollama:gemma3:270m", "/m/qwen-q4.gguf"], FLAGS, ollama)
    assert [m.name for m in cfg.models] == ["gemma3:270m", "qwen-q4"]
    assert cfg.models[0].source == "ollama:gemma3:270m"


def test_lora_requests_are_known_by_model_name_or_the_lora_field():
    adapters = ("sql", "chat")
    assert lora_request({"model": "sql"}, adapters)
    assert lora_request({"model": "demo", "lora": [{"name": "sql"}]}, adapters)
    assert not lora_request({"model": "demo", "lora": []}, adapters)
    assert not lora_request({"model": "demo"}, adapters) and not lora_request({}, ())


def test_the_session_key_that_keeps_a_client_on_one_replica():
    assert session_key("s1", {"user": "u", "prompt_cache_key": "k"}) == "s1"
    assert session_key(None, {"user": "u", "prompt_cache_key": "k"}) == "k"
    assert session_key(None, {"user": "u", "safety_identifier": "s"}) == "u"
    assert session_key(None, {"safety_identifier": "s"}) == "s"
    assert session_key(None, {"metadata": {"user_id": "a"}}) == "a"  # Anthropic's
    assert session_key(None, {"user": 5, "metadata": "x"}) is None
    assert session_key("", {"user": ""}) is None


def test_a_model_whose_runner_would_refuse_its_flags_or_find_no_file_is_refused_at_start(
        tmp_path, model_path):
    """The gateway started with these; the model failed at its first request."""
    from justllm.gateway.config import check_sources

    for entry, says in (({"max-seqs": -3}, "max-seqs must be an integer >= 1"),
                        ({"ctx": "big"}, r"ctx must be an integer \(got 'big'\)")):
        with pytest.raises(ValueError, match=says):
            load_config({"models": {"m": {"source": "demo", **entry}}}, FLAGS)
    check_sources(load_config({"models": {"a": model_path, "b": "acme/x:y.gguf"}}, FLAGS))
    cut = tmp_path / "cut.gguf"  # the model's own failure (test_gateway.py), not the gateway's
    cut.write_bytes(b"GGUF")
    check_sources(load_config({"models": {"a": str(cut)}}, FLAGS))
    with pytest.raises(ValueError, match="model 'c': source .*gone.gguf is not a file"):
        check_sources(load_config({"models": {"c": str(tmp_path / "gone.gguf")}}, FLAGS))


def test_switches_take_true_or_false_and_other_flags_a_value():
    """``gpu: "false"`` added --gpu, ``no-prefix-cache: 1`` made its 1 a second MODEL (so the
    runner went into router mode), ``preload: "no"`` preloaded, ``max-seqs: true`` gave a
    bare --max-seqs: all were accepted at start-up."""
    for entry, says in (({"gpu": "false"}, "gpu must be true or false"),
                        ({"gpu": 1}, "gpu must be true or false"),
                        ({"max-seqs": True}, "max-seqs must be a value"),
                        ({"preload": "no"}, "preload must be true or false")):
        with pytest.raises(ValueError, match=f"model 'm': {says}"):
            load_config({"models": {"m": {"source": "demo", **entry}}}, FLAGS)
    spec = load_config({"models": {"m": {"source": "demo", "gpu": True, "preload": False}}},
                       FLAGS).models[0]
    assert "--gpu" in spec.runner_args() and not spec.preload
    assert "--gpu" not in load_config({"models": {"m": {"source": "demo", "gpu": False}}},
                                      FLAGS).models[0].runner_args()


def test_the_error_a_runner_reports_is_the_one_of_its_own_start(tmp_path):
    """The log file holds every start of the model; an earlier run's error was reported as
    the failure of the current one (with its 'error:' prefix doubled in the message)."""
    from justllm.gateway.runner import last_error_line, log_model, log_name

    log = tmp_path / "m.log"
    log.write_text("--- starting\nerror: an old failure\n--- starting\n")
    start = log.stat().st_size
    with log.open("a") as f:
        f.write("loading\nlistening\n")
    assert last_error_line(log) == "an old failure"
    assert last_error_line(log, start) == "listening"
    with log.open("a") as f:
        f.write("error: this one\n")
    assert last_error_line(log, start) == "this one"
    assert log_name("org/m") == "org%2Fm.log" and log_name("../x", "1") == "..%2Fx@1.log"
    assert log_model(tmp_path / log_name("org/m:q4", "2")) == "org/m:q4@2"



def test_lora_ids_past_models_yamls_adapters_are_the_ones_replicas_may_disagree_on():
    from justllm.gateway.policy import unstable_lora_id

    assert unstable_lora_id({"lora": [{"id": 0}, {"id": 1, "scale": 0.5}]}, 2) is None
    assert unstable_lora_id({"lora": [{"name": "x"}, {"id": 2}]}, 2) == 2
    assert unstable_lora_id({"lora": [{"id": 0}]}, 0) == 0
    assert unstable_lora_id({"prompt": "no lora"}, 0) is None
    assert unstable_lora_id({"lora": "not a list: the runner says so"}, 0) is None
