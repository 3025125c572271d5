"""The gateway's configuration: ``models.yaml`` (or a list of models, or a directory) parsed and
validated once, before anything starts.

    max-loaded: 2            # most models loaded at once; the least recently used idle one goes
    max-memory: 8GB          # most estimated runner memory at once (weights + KV + logits)
    load-timeout: 120        # seconds a request waits for its model to load
    max-waiting: 64          # requests waiting for loads, beyond which a 503 answers
    poll-interval: 0.25      # seconds between reads of each replica's /metrics
    health-timeout: 30       # seconds a local runner may not answer them before it is restarted
    models:
      chat:
        source: gemma-3-270m-q4_k_m:latest   # a registry name, a path or REPO:FILE
        aliases: [gpt-4o-mini]
        ttl: 300              # idle seconds before unloading; -1 never
        preload: true
        max-seqs: 8           # any engine flag of `justllm serve`
        ctx: 2048
      busy:
        source: /models/qwen.gguf
        min-replicas: 1       # the autoscaler's bounds (or a fixed `replicas: 2`)
        max-replicas: 4
        target-ongoing: 4     # requests in flight per replica it aims at
        gpus: [0, 1, 2, 3]    # replica i gets CUDA_VISIBLE_DEVICES=gpus[i % len]
        urls: [http://10.0.0.7:8080]   # replicas elsewhere (any `justllm serve`)
        api-key: ${BUSY_KEY}  # what the urls ask for (--api-key there); $VAR: from the env
        routing: cache-aware  # or a mapping of the routing options
      split:
        source: /models/qwen.gguf
        prefill-replicas: 1   # prefill/decode disaggregation: a count, a list of urls, or
        decode-replicas: {min-replicas: 1, max-replicas: 3}   # the autoscaler's mapping
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from justllm.config import EngineConfig, LoraSpec, read_yaml, yaml_on_off
from justllm.gateway.autoscale import AutoscaleConfig
from justllm.gateway.policy import parse_size
from justllm.gateway.routing import Policy, RoutingConfig, routing_config
from justllm.models.lora import not_a_file
from justllm.models.source import ModelSource
from justllm.spec.methods import SPEC_METHODS, SpecMethod

log = logging.getLogger(__name__)

DEFAULT_TTL = 300.0
_SCALE_KEYS = {"min-replicas", "max-replicas", "target-ongoing", "upscale-delay",
               "downscale-delay"}
_PD_KEYS = {"prefill-replicas", "decode-replicas"}
# Prompts shorter than this (an estimate: tokens given, else 4 characters a token) are computed
# on the decode replica: a hand-over costs more than their prefill saves.
DEFAULT_PREFILL_MIN_TOKENS = 128
_MODEL_KEYS = {"source", "aliases", "ttl", "preload", "replicas", "gpus", "urls", "routing",
               "prefill-min-tokens", "api-key", *_SCALE_KEYS, *_PD_KEYS}
_TOP_KEYS = {"models", "max-loaded", "max-memory", "load-timeout", "max-waiting",
             "poll-interval", "health-timeout"}


@dataclass(frozen=True)
class Flags:
    """The engine flags a runner takes (YAML names: ``max-seqs``), and the values given on the
    gateway's own command line, which every model gets unless its entry says otherwise."""

    names: frozenset[str]
    defaults: dict[str, Any] = field(default_factory=dict)
    # The routing policies ``routing:`` may name (with plugins, Plugins.routing_policies);
    # None: the built-in ones.
    routing_policies: Mapping[str, type[Policy]] | None = None
    # Where model sources are looked up for max-memory's estimate (Plugins.model_sources);
    # None: the built-in ones.
    model_sources: tuple[ModelSource, ...] | None = None
    # The flags that take no value (``gpu``): YAML must give them true or false (``gpu:
    # "false"`` would have added --gpu; ``no-prefix-cache: 1`` made its 1 a second MODEL).
    switches: frozenset[str] = frozenset()
    # The methods ``spec:`` may name (with plugins, Plugins.spec_methods); None: the built-in
    # ones.
    spec_methods: Mapping[str, SpecMethod] | None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    aliases: tuple[str, ...] = ()
    ttl: float = DEFAULT_TTL  # < 0: never unload
    preload: bool = False
    flags: tuple[tuple[str, Any], ...] = ()  # engine flags for the runner, YAML names
    replicas: int = 1  # local runner processes while loaded (the autoscaler's start: its min)
    gpus: tuple[int, ...] = ()  # CUDA_VISIBLE_DEVICES of local replica i: gpus[i % len]
    urls: tuple[str, ...] = ()  # remote replicas (other `justllm serve`s), always in rotation
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    autoscale: AutoscaleConfig | None = None  # min-replicas / max-replicas given
    # Prefill/decode disaggregation: each local replica's and each url's role ("both" if not).
    roles: tuple[str, ...] = ()
    url_roles: tuple[str, ...] = ()
    prefill_min_tokens: int = DEFAULT_PREFILL_MIN_TOKENS
    # PD: the autoscaler's settings for a role's local replicas (``prefill-replicas`` or
    # ``decode-replicas`` given as a mapping of min-replicas, max-replicas, ...).
    role_autoscale: tuple[tuple[str, AutoscaleConfig], ...] = ()
    # The key the urls ask for (their --api-key), sent to them only; kept out of repr (logs).
    url_api_key: str | None = field(default=None, repr=False)

    @property
    def pd(self) -> bool:
        return "prefill" in self.roles + self.url_roles

    @property
    def scaled_pools(self) -> tuple[tuple[str, AutoscaleConfig], ...]:
        """The autoscaled pools of local replicas, by role: ("both", the model's settings)
        for a model without PD; a PD model's scaled roles, each with its own."""
        return (("both", self.autoscale),) if self.autoscale is not None else self.role_autoscale

    @property
    def remote_only(self) -> bool:
        """Served by its urls alone: nothing loads here (it holds no place under max-loaded)."""
        return self.replicas == 0 and not self.scaled_pools

    @property
    def pinned(self) -> bool:
        """Never unloaded: an autoscaled model with ``min-replicas`` >= 1 (its ttl is -1)."""
        return self.autoscale is not None and self.autoscale.min_replicas >= 1

    @property
    def adapters(self) -> tuple[str, ...]:
        """The names of the model's LoRA adapters (``lora: [NAME=PATH[:SCALE], ...]``): clients
        send them as ``model``, and the runner serves them on this model."""
        return tuple(v.split("=", 1)[0] for k, v_all in self.flags if k == "lora"
                     for v in v_all)

    @property
    def lora_specs(self) -> tuple[LoraSpec, ...]:
        """The model's adapters as its runners load them (checked when models.yaml is read)."""
        return tuple(LoraSpec.parse(v) for k, v_all in self.flags if k == "lora" for v in v_all)

    @property
    def lora_runtime(self) -> bool:
        """Its replicas take LoRA adapters loaded at run time (``enable-lora-runtime``)."""
        return bool(dict(self.flags).get("enable-lora-runtime"))

    def role_of(self, index: int) -> str:
        return self.roles[index] if index < len(self.roles) else "both"

    def gpu_of(self, index: int) -> int | None:
        return self.gpus[index % len(self.gpus)] if self.gpus else None

    def unset_switches_env(self) -> frozenset[str]:
        """The environment variables of the switches this model turns off (``gpu: false``):
        its runner must not inherit them from the gateway, whose own environment already
        reached every model's flags (a model's entry wins), else ``JUSTLLM_GPU=1`` beside
        ``gpu: false`` put that model on the GPU (``--gpu`` has no ``--no-gpu``)."""
        return frozenset(f"JUSTLLM_{key.upper().replace('-', '_')}" for key, value in self.flags
                         if value is False)

    def runner_args(self) -> list[str]:
        """The flags as ``justllm serve`` arguments."""
        args: list[str] = []
        for key, value in self.flags:
            if isinstance(value, bool):
                if value:
                    args.append(f"--{key}")
            elif isinstance(value, (list, tuple)):  # a repeatable flag: --lora A=.. --lora B=..
                for item in value:
                    args += [f"--{key}", str(item)]
            else:
                args += [f"--{key}", str(value)]
        return args


@dataclass(frozen=True)
class GatewayConfig:
    models: tuple[ModelSpec, ...]
    max_loaded: int = 0  # 0: no limit
    max_memory: int = 0  # bytes; 0: no limit
    load_timeout: float = 120.0
    max_waiting: int = 64
    # Seconds between two reads of each replica's /metrics (load, KV use, hit ratio, TTFT).
    poll_interval: float = 0.25
    # Seconds a local runner may fail its /metrics polls before it is restarted (a hung
    # process: Ray Serve's health_check_timeout_s, whose default this is).
    health_timeout: float = 30.0
    names: dict[str, str] = field(default_factory=dict)  # name or alias -> model name
    model_sources: tuple[ModelSource, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("the gateway needs at least one model")
        names: dict[str, str] = {}
        for m in self.models:
            for n in (m.name, *m.aliases, *m.adapters):
                if n in names:
                    raise ValueError(f"model name, alias or LoRA adapter '{n}' is used twice")
                names[n] = m.name
        object.__setattr__(self, "names", names)
        # (written so that a NaN, which no comparison holds for, breaks the rule)
        for bad, rule in ((not self.max_loaded >= 0, "max-loaded must be >= 0"),
                          (not 0 < self.load_timeout < math.inf,
                           "load-timeout must be > 0 seconds"),
                          (not self.max_waiting >= 1, "max-waiting must be >= 1"),
                          (not 0.01 <= self.poll_interval <= 60,
                           "poll-interval must be in [0.01, 60] seconds"),
                          (not 1 <= self.health_timeout < math.inf,
                           "health-timeout must be >= 1 second")):
            if bad:
                raise ValueError(rule)
        preloads = [m.name + (" (min-replicas >= 1)" if m.pinned else "")
                    for m in self.models if m.preload and not m.remote_only]
        if 0 < self.max_loaded < len(preloads):
            raise ValueError(f"{len(preloads)} models preload ({', '.join(preloads)}) but "
                             f"max-loaded is {self.max_loaded}: they would unload one another "
                             f"as the gateway starts; preload at most {self.max_loaded}, or "
                             "raise max-loaded")
        pinned = [m.name for m in self.models if m.pinned and not m.remote_only]
        others = [m.name for m in self.models if not m.pinned and not m.remote_only]
        if 0 < self.max_loaded <= len(pinned) and others:
            raise ValueError(f"max-loaded is {self.max_loaded} and {', '.join(pinned)} "
                             f"(min-replicas >= 1) never unload: {', '.join(others)} could "
                             "never load; raise max-loaded, or give them min-replicas: 0")

    def spec(self, name: str) -> ModelSpec:
        return next(m for m in self.models if m.name == name)


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number (got {value!r})")
    if not math.isfinite(value):  # YAML's .inf and .nan: every check of a NaN is false
        raise ValueError(f"{where} must be a finite number (got {value!r})")
    return float(value)


def _integer(where: str, value: Any) -> int:
    """A count (``max-loaded``): an integer, not a number cut down to one (1.7 was 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where} must be an integer (got {value!r})")
    return value


def _count(where: str, value: Any, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{where} must be an integer >= {least} (got {value!r})")
    return value


def _replicas(name: str, entry: dict, flags: Flags, batch: int | None = None
              ) -> dict[str, Any]:
    """The replica keys of a model's entry as ModelSpec fields (``batch``: the runners'
    ``max-seqs`` where given, see :func:`routing_config`)."""
    where = f"model '{name}'"
    urls = entry.get("urls")
    if urls is None:
        urls = []
    elif isinstance(urls, str):
        urls = [urls]
    if not isinstance(urls, list) or not all(
            isinstance(u, str) and u.startswith(("http://", "https://"))
            and urlsplit(u).hostname for u in urls):  # (an 'http://' was polled for ever)
        raise ValueError(f"{where}: urls must be http(s)://HOST[:PORT] addresses of "
                         "`justllm serve`s")
    urls = [u.rstrip("/") for u in urls]  # http://h:1/ is http://h:1
    if len(set(urls)) != len(urls):
        raise ValueError(f"{where}: a url is listed twice")
    # A list, even of one: a bare number (``gpus: 0``, which was ignored) could mean a
    # device or a count of them.
    gpus = entry.get("gpus")
    if gpus is None:
        gpus = []
    if not isinstance(gpus, list) or not all(
            isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
        raise ValueError(f"{where}: gpus must be a list of device numbers such as [0, 1] "
                         f"(got {gpus!r})")
    if _PD_KEYS & entry.keys():
        return _pd_replicas(name, entry, flags, batch)
    if "prefill-min-tokens" in entry:
        raise ValueError(f"{where}: prefill-min-tokens needs prefill-replicas and "
                         "decode-replicas")
    scaled = {k: entry[k] for k in _SCALE_KEYS if k in entry}
    autoscale = None
    if scaled:
        tuning = ", ".join(sorted(scaled.keys() - {"min-replicas", "max-replicas"}))
        if "replicas" in entry:
            raise ValueError(f"{where}: give replicas (a fixed count) or the autoscaler's "
                             f"keys ({', '.join(sorted(scaled))}), not both")
        if not {"min-replicas", "max-replicas"} & scaled.keys():
            # Alone they made an autoscaler of one replica, always loaded.
            raise ValueError(f"{where}: {tuning} tune the autoscaler, which needs its bounds: "
                             "max-replicas (and min-replicas, default 1)")
        if urls:
            raise ValueError(f"{where}: the autoscaler scales local replicas; a model with "
                             "urls has a fixed set (give replicas instead)")
        autoscale = _autoscale_config(where, scaled)
        low = autoscale.min_replicas
        if low >= 1 and "ttl" in entry:
            raise ValueError(f"{where}: ttl unloads an idle model; with min-replicas >= 1 it "
                             "stays loaded (min-replicas: 0 scales to zero after ttl)")
        if low >= 1 and entry.get("preload") is False:  # (it was loaded at start-up all the same)
            raise ValueError(f"{where}: preload: false loads the model at its first request; "
                             "with min-replicas >= 1 it is loaded at start-up (min-replicas: 0 "
                             "waits for a request)")
        replicas = max(low, 1)
    else:
        # A source means a local replica unless told otherwise; urls alone, none.
        replicas = _count(f"{where}: replicas", entry.get("replicas", 1 if entry.get("source")
                                                          else 0))
        if replicas == 0 and not urls:
            raise ValueError(f"{where}: replicas must be >= 1 (or, in router mode, give urls)")
    try:
        routing = routing_config(entry.get("routing"), flags.routing_policies, batch)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return {"replicas": replicas, "gpus": tuple(gpus), "urls": tuple(urls), "routing": routing,
            "autoscale": autoscale, "roles": (), "url_roles": ("both",) * len(urls)}


def _pd_replicas(name: str, entry: dict, flags: Flags, batch: int | None) -> dict[str, Any]:
    """``prefill-replicas`` and ``decode-replicas``: each a count of local replicas, a list of
    urls, or a mapping of the autoscaler's keys (its local replicas then grow and shrink with
    that role's load); with a prefill-capable and a decode-capable replica at least."""
    where = f"model '{name}'"
    if not _PD_KEYS <= entry.keys():
        raise ValueError(f"{where}: give both prefill-replicas and decode-replicas")
    clash = sorted(({"replicas", "urls", "gpus"} | _SCALE_KEYS) & entry.keys())
    if clash:
        raise ValueError(f"{where}: prefill-replicas / decode-replicas replace "
                         f"{', '.join(clash)} (to autoscale a role, give it a mapping: "
                         "decode-replicas: {min-replicas: 1, max-replicas: 3})")
    roles: list[str] = []
    urls: list[str] = []
    url_roles: list[str] = []
    scaled: list[tuple[str, AutoscaleConfig]] = []
    for key, role in (("prefill-replicas", "prefill"), ("decode-replicas", "decode")):
        value = entry[key]
        if isinstance(value, list):
            got = _replicas(name, {"urls": value}, flags)["urls"]
            urls += got
            url_roles += [role] * len(got)
        elif isinstance(value, dict):
            config = _role_autoscale(f"{where}: {key}", value)
            scaled.append((role, config))
            roles += [role] * config.min_replicas
        else:
            roles += [role] * _count(f"{where}: {key}", value, 1)
    if len(set(urls)) != len(urls):
        raise ValueError(f"{where}: a url is listed twice")
    if roles and not entry.get("source"):
        raise ValueError(f"{where}: local replicas need a 'source'")
    try:
        routing = routing_config(entry.get("routing"), flags.routing_policies, batch)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return {"replicas": len(roles), "gpus": (), "urls": tuple(urls), "routing": routing,
            "autoscale": None, "roles": tuple(roles), "url_roles": tuple(url_roles),
            "role_autoscale": tuple(scaled),
            "prefill_min_tokens": _count(f"{where}: prefill-min-tokens",
                                         entry.get("prefill-min-tokens",
                                                   DEFAULT_PREFILL_MIN_TOKENS))}


def _role_autoscale(where: str, value: dict) -> AutoscaleConfig:
    """A PD role's autoscaler: the model-level keys, with min-replicas >= 1 (a role with no
    replica would send every request the long way round; unloading is the ttl's business)."""
    unknown = sorted(k for k in value if k not in _SCALE_KEYS)
    if unknown or "max-replicas" not in value:
        raise ValueError(f"{where}: a mapping of {', '.join(sorted(_SCALE_KEYS))} "
                         f"(max-replicas required){'; unknown: ' + ', '.join(unknown) if unknown else ''}")
    return _autoscale_config(where, value, least_min=1)


def _autoscale_config(where: str, scaled: dict, least_min: int = 0) -> AutoscaleConfig:
    """The autoscaler's keys (``_SCALE_KEYS``) checked: min-replicas (default 1, at least
    ``least_min``), max-replicas (default max(min-replicas, 1)) and the options."""
    low = _count(f"{where}: min-replicas", scaled.get("min-replicas", 1), least_min)
    high = _count(f"{where}: max-replicas", scaled.get("max-replicas", max(low, 1)), 1)
    options = {k.replace("-", "_"): _number(f"{where}: {k}", v) for k, v in scaled.items()
               if k not in ("min-replicas", "max-replicas")}
    try:
        return AutoscaleConfig(low, high, **options)
    except ValueError as e:  # (its own rules, which know no model: said with ``where``)
        raise ValueError(f"{where}: {e}") from None


def _tidy(name: str) -> bool:
    """A name clients can send and ``justllm ps`` can print: no spaces at its ends, no
    control characters."""
    return name == name.strip() and name.isprintable()


def model_spec(name: str, entry: Any, flags: Flags) -> ModelSpec:
    if not name.strip():  # ('' was served, and its runner log was named .log)
        raise ValueError(f"a model's name is empty ({name!r}): give it a name")
    if not _tidy(name):  # (a newline broke `justllm ps`)
        raise ValueError(f"model name {name!r} has spaces at an end or a control character")
    if "@" in name:  # (x@1 shared its log file with replica 1 of x)
        raise ValueError(f"model name {name!r}: '@' marks a replica in a log file's name "
                         "(MODEL@1.log); name the model without it")
    if isinstance(entry, str):
        entry = {"source": entry}
    if isinstance(entry, dict) and "source" not in entry and (entry.get("urls") and not entry.get("replicas") or _PD_KEYS & entry.keys()):
        entry = {**entry, "source": ""}  # replicas elsewhere only: nothing to load here
    if not isinstance(entry, dict) or not isinstance(entry.get("source"), str):
        raise ValueError(f"model '{name}' needs a 'source' (a registry name, a path or "
                         "REPO:FILE)")
    entry = {k: yaml_on_off(k, v) for k, v in entry.items()}
    known = flags.names
    unknown = sorted(k for k in entry if k not in _MODEL_KEYS and k not in known)
    if unknown:
        raise ValueError(f"model '{name}': unknown key(s) {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(_MODEL_KEYS))} and the engine flags of "
                         "`justllm serve`)")
    aliases = entry.get("aliases")
    if aliases is None:
        aliases = []
    elif isinstance(aliases, str):
        aliases = [aliases]
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a.strip()
                                                for a in aliases):
        raise ValueError(f"model '{name}': aliases must be names")
    for alias in aliases:  # (as a model's name: " x" and "z\n" were served)
        if not _tidy(alias):
            raise ValueError(f"model '{name}': alias {alias!r} has spaces at an end or a "
                             "control character")
    values = {**flags.defaults, **{k: v for k, v in entry.items() if k in known}}
    for key, value in entry.items():
        if key in known and ((key in flags.switches) != isinstance(value, bool)
                             or value is None):  # (null was passed on as --key None)
            raise ValueError(f"model '{name}': {key} must be "
                             f"{'true or false' if key in flags.switches else 'a value'}"
                             f" (got {value!r})")
    if not isinstance(entry.get("preload", False), bool):
        raise ValueError(f"model '{name}': preload must be true or false "
                         f"(got {entry['preload']!r})")
    if "lora" in values:
        values["lora"] = _lora_list(name, values["lora"])
    _check_engine_flags(name, values, flags.spec_methods)
    seqs = values.get("max-seqs")
    replicas = _replicas(name, entry, flags,
                         seqs if isinstance(seqs, int) and not isinstance(seqs, bool) else None)
    _check_flags_run_here(name, entry, flags, replicas)
    replicas["url_api_key"] = _url_api_key(name, entry.get("api-key"), replicas["urls"])
    pinned = replicas["autoscale"] is not None and replicas["autoscale"].min_replicas >= 1
    return ModelSpec(name=name, source=entry["source"], aliases=tuple(aliases),
                     ttl=-1.0 if pinned else _number(f"model '{name}': ttl",
                                                     entry.get("ttl", DEFAULT_TTL)),
                     preload=pinned or entry.get("preload", False),
                     flags=tuple(sorted(values.items())), **replicas)


# A model's keys that mean something to the gateway even when all its replicas are urls: its
# adapters' names are model names clients send, and runtime adapters reach the urls too.
_GATEWAY_READ_FLAGS = frozenset({"lora", "enable-lora-runtime"})


def _check_flags_run_here(name: str, entry: dict, flags: Flags, replicas: dict) -> None:
    """Engine flags in the entry of a model with no local replica (urls only) would reach no
    runner: refused, not ignored (the `justllm serve` behind each url has its own). The
    gateway's command-line flags, given for every model, are no error here. (An autoscaled
    model, or PD role, has at least one local replica: its min-replicas, or 1.)"""
    if replicas["replicas"]:
        return
    unused = sorted(k for k in entry if k in flags.names and k not in _GATEWAY_READ_FLAGS)
    if unused:
        raise ValueError(f"model '{name}': {', '.join(unused)}: engine flags of local "
                         "replicas, and this model's replicas are all urls (give them to the "
                         "`justllm serve` behind each url)")


_ENV_REF = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def _url_api_key(name: str, value: Any, urls: tuple[str, ...]) -> str | None:
    """A model's ``api-key``: the key its remote replicas (``urls``) were started with, as a
    literal or ``$VAR`` / ``${VAR}``, read from the gateway's environment (so the file need
    not hold it)."""
    where = f"model '{name}': api-key"
    if value is None:
        return None
    if not urls:
        raise ValueError(f"{where} is the key of the model's urls (remote replicas); it has "
                         "none (local replicas get a key of their own)")
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where} must be a string (the urls' --api-key, or $VAR)")
    ref = _ENV_REF.fullmatch(value.strip())
    if ref is None:
        return value.strip()
    var = ref.group(1) or ref.group(2)
    key = os.environ.get(var, "").strip()
    if not key:
        raise ValueError(f"{where} names the environment variable {var}, which is not set")
    return key


def gguf_path(source: str) -> Path | None:
    """The file a model source names when it is a path (``x.gguf``, ``~/m.gguf``), or None
    for a registry name or ``REPO:FILE``."""
    if source.lower().endswith(".gguf") and ":" not in source:
        return Path(source).expanduser()
    return None


def check_sources(config: GatewayConfig) -> None:
    """Every source that is a path names a file: asked when the gateway starts (it started,
    and the model failed at its first request). A file that is there but not a whole GGUF is
    the model's own failure, a 503 for its requests while the others serve, until a load of
    the mended file (POST /models/load): one bad model does not stop the gateway."""
    for m in config.models:
        path = gguf_path(m.source)
        if path is not None and not path.is_file():
            raise ValueError(f"model '{m.name}': source {m.source} is not a file")
        if m.source and path is None and _is_dir(Path(m.source).expanduser()):
            # (as `justllm serve DIR` refuses it; it was taken, and failed at a request)
            raise ValueError(f"model '{m.name}': source {m.source} is a directory; give a "
                             ".gguf file or a model name")
        for lora in m.lora_specs:  # (its runner refused it at each try of the first load)
            file = Path(lora.path).expanduser()
            missing = not_a_file(file)
            if missing is not None:  # (the first words of the runner's own check_lora_file)
                raise ValueError(f"model '{m.name}': LoRA adapter {file}: {missing}")


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


# EngineConfig checks these when the runner starts; the gateway asks it too, at start-up.
# (The others are resolved by the runner: the model and the LoRA files; the draft model is
# only told from its absence, as EngineConfig does. A chat template's file or built-in name
# is the engine's to read: `justllm serve` asks it before the gateway starts.)
_CHECKED_FLAGS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {
    "model", "spec_methods", "lora"}


def _check_engine_flags(name: str, values: dict[str, Any],
                        spec_methods: Mapping[str, SpecMethod] | None = None) -> None:
    """An engine flag with a value the runner would refuse (``max-seqs: -3``, ``spec:
    bogus``) is refused now."""
    _engine_config(name, name, values, spec_methods)


def runner_engine_config(spec: ModelSpec,
                         spec_methods: Mapping[str, SpecMethod] | None = None) -> EngineConfig:
    """The EngineConfig a local runner of ``spec`` starts with, as far as the gateway can tell
    (its source as given, unresolved; no LoRA files), for checks that need the model's file
    (``--pool-blocks`` against this machine's memory)."""
    return _engine_config(spec.name, spec.source, dict(spec.flags), spec_methods)


def _engine_config(name: str, model: str, values: dict[str, Any],
                   spec_methods: Mapping[str, SpecMethod] | None) -> EngineConfig:
    given = {key: v for k, v in values.items()
             if (key := k.replace("-", "_")) in _CHECKED_FLAGS}
    if "spec" in given or "draft_model" in given:  # as the runner reads them (config_values):
        given["spec"] = given.get("spec") or ("draft" if given.get("draft_model") else "")
    try:
        return EngineConfig(model=model, **given,
                            spec_methods=SPEC_METHODS if spec_methods is None else spec_methods)
    except ValueError as e:
        said = str(e)
        for key in given:  # in models.yaml's spelling: max_seqs is max-seqs there
            said = re.sub(rf"\b{key}\b", key.replace("_", "-"), said)
        raise ValueError(f"model '{name}': {said}") from None
    except TypeError:  # a comparison with a value of the wrong type
        wrong = ", ".join(f"{k.replace('_', '-')}: {v!r}" for k, v in given.items())
        raise ValueError(f"model '{name}': an engine flag has a value of the wrong type "
                         f"({wrong})") from None


def _lora_list(name: str, value: Any) -> tuple[str, ...]:
    """A model's ``lora``: ``NAME=PATH[:SCALE]`` strings (one or a list, as ``--lora``), or
    a mapping of adapter names to ``PATH[:SCALE]``. The runner checks the files."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, dict):
        value = [f"{k}={v}" for k, v in value.items()]
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, str) and "=" in v for v in value):
        raise ValueError(f"model '{name}': lora must be NAME=PATH[:SCALE] strings (a list) or "
                         "a mapping of adapter names to PATH[:SCALE]")
    for v in value:  # a bad name or scale now, not from every replica as it starts
        try:
            LoraSpec.parse(v)
        except ValueError as e:
            raise ValueError(f"model '{name}': {e}") from None
    return tuple(value)


def load_config(data: Any, flags: Flags, source: str = "models.yaml") -> GatewayConfig:
    """A parsed models.yaml (``source``: the file, as its errors name it)."""
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise ValueError(f"{source} must be a mapping with a 'models' mapping of name -> "
                         "model")
    unknown = sorted(k for k in data if k not in _TOP_KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(_TOP_KEYS))})")
    for n in data["models"]:
        if n is None:  # (it was served as "None")
            raise ValueError(f"{source}: a model's name is ~ (null): give it a name")
        if isinstance(n, bool):  # (it was served as "True")
            raise ValueError(f"{source}: a model is named {str(n).lower()}, which is how "
                             "YAML reads an unquoted yes, no, on, off, true or false: quote "
                             "the name")
    models = tuple(model_spec(str(n), e, flags) for n, e in data["models"].items())
    try:
        max_memory = parse_size(data.get("max-memory", 0))
    except ValueError as e:
        raise ValueError(f"max-memory: {e}") from None
    return GatewayConfig(
        models, max_loaded=_integer("max-loaded", data.get("max-loaded", 0)),
        max_memory=max_memory,
        load_timeout=_number("load-timeout", data.get("load-timeout", 120)),
        max_waiting=_integer("max-waiting", data.get("max-waiting", 64)),
        poll_interval=_number("poll-interval", data.get("poll-interval", 0.25)),
        health_timeout=_number("health-timeout", data.get("health-timeout", 30)),
        model_sources=flags.model_sources)


def read_config(path: str, flags: Flags) -> GatewayConfig:
    return load_config(read_yaml(path), flags, path)


# llama.cpp's gguf-split file names: NAME-00001-of-00003
_SPLIT = re.compile(r"^(.+)-(\d{5})-of-\d{5}$")


def directory_config(directory: str, flags: Flags) -> GatewayConfig:
    """Every GGUF in ``directory`` (and below; ``.gguf`` in any case) as a model named by its
    file stem (llama-server's --models-dir); of several files with one stem, the newest. A
    split model (``NAME-00001-of-00003.gguf`` ...) is one model, NAME, loaded from its first
    part (llama.cpp finds the others beside it)."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"--models-dir {directory} is not a directory")
    found = sorted(p for p in root.rglob("*") if p.suffix.lower() == ".gguf")
    for p in found:
        if p.is_symlink() and not p.exists():
            log.warning("--models-dir: %s is a link to %s, which does not exist: left out", p,
                        os.readlink(p))
    paths = [p for p in found if p.is_file()]
    if not paths:
        raise ValueError(f"no .gguf files in {directory}")
    newest: dict[str, Path] = {}  # one model per name: two revisions of a file -> the newer
    parts: dict[str, Path] = {}  # a later part of a split model, by its model's name
    older: list[tuple[Path, str]] = []  # files left out for a newer one of the same name
    for p in paths:
        split = _SPLIT.match(p.stem)
        name = split.group(1) if split else p.stem
        if "@" in name:  # (a model name cannot hold it: see model_spec; one file, not all)
            log.warning("--models-dir: %s: left out ('@' marks a replica in a log file's "
                        "name; rename the file to serve it)", p)
            continue
        if split and int(split.group(2)) != 1:
            parts.setdefault(name, p)  # (llama.cpp loads the first part)
            continue
        if name in newest:
            keep, drop = ((p, newest[name]) if p.stat().st_mtime > newest[name].stat().st_mtime
                          else (newest[name], p))
            older.append((drop, name))
            newest[name] = keep
        else:
            newest[name] = p
    for p, name in older:
        log.warning("--models-dir: %s: left out, model %s is the newer %s", p, name,
                    newest[name])
    orphans = [f"{p.name} is a later part of a split model whose first part "
               f"({name}-00001-of-...) is not there" for name, p in parts.items()
               if name not in newest]
    if not newest:
        raise ValueError(f"no model in {directory}: " + ("; ".join(orphans) or "every .gguf "
                                                          "there was left out (the warnings "
                                                          "above say why)"))
    for line in orphans:
        log.warning("--models-dir: %s: left out", line)
    return GatewayConfig(tuple(model_spec(name, str(p), flags)
                               for name, p in sorted(newest.items())))


def model_name(ref: str) -> str:
    """The id a model given on the command line is served as: a file's stem (of a path or a
    REPO:FILE), else the ref itself (a registry name:tag)."""
    return Path(ref.rsplit(":", 1)[-1]).stem if ref.endswith(".gguf") else ref


def list_config(refs: list[str], flags: Flags,
                served_name: Callable[[str], str | None] | None = None) -> GatewayConfig:
    """``justllm serve A B ...``: each model under its own name: the one a plugin's model
    source gives it (``served_name``: ``ollama:llama3.2`` is ``llama3.2``, as a single
    ``serve ollama:llama3.2`` answers to), else ``model_name``."""
    def name(ref: str) -> str:
        return (served_name(ref) if served_name else None) or model_name(ref)

    return GatewayConfig(tuple(model_spec(name(r), r, flags) for r in refs))
