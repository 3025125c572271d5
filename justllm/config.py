"""The engine's configuration: one dataclass, validated once, passed down."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from justllm.core.policy import SCHEDULING_POLICIES
from justllm.core.reasoning import REASONING_FORMATS
from justllm.core.sampling_params import MAX_DRAFT, MAX_LORA_SCALE
from justllm.core.scheduler import SchedulerConfig
from justllm.kv.radix_cache import EVICTION_POLICIES
from justllm.spec.methods import SPEC_METHODS, SpecMethod

MAX_SPEC_OUTPUTS = 256
# llama.cpp's CPU matmul computes the output head for rows in groups of 4 (measured on this
# model: 3 logits rows 93 ms, 4 rows 66 ms), so output rows are padded to a multiple of it.
CPU_ROW_MULTIPLE = 4
# llama.cpp's CPU flash attention takes a batch of this many tokens or more in tiles of this
# many queries (GGML_FA_TILE_Q): a step's decodes then go in a llama_decode of their own
# (core/scheduler.py ``split_decodes_at``).
CPU_FA_QUERY_TILE = 64
# Sequence ids one context may use: llama.cpp's 256, halved because each has a twin on
# sliding-window models (LlamaBackend: keep_swa_cells).
MAX_SEQ_IDS = 128
# ggml's GGML_MAX_N_THREADS (ggml.h): the CPU backend's thread pool has room for this many; past
# it llama.cpp aborts (std::bad_alloc at 99999), fails in libgomp (40000) or hangs (20000).
MAX_THREADS = 512
# The most tokens a KV pool (``pool_blocks * block_size``, llama.cpp's ``n_ctx``) may have:
# llama.cpp counts a context's tokens in 32 bits, padded up to a multiple of 256, and its
# positions are signed 32-bit; ctypes would cut a larger n_ctx to its low 32 bits silently.
MAX_POOL_TOKENS = 2**31 - 1
MAX_N_BATCH = 65536  # tokens in one llama_decode (llama-server's default is 2048)


def default_spare_seq_ids(max_seqs: int) -> int:
    """Sequence ids above ``max_seqs`` when none are given: one for each running request and
    8 more, at least 32, as many as llama.cpp's ids leave. Each cached prefix a running request
    hit stays held by an id of its own while the request runs (kv/radix_cache.py), so with
    fewer than ``max_seqs`` spare ids a load that sends its prompts again runs short of ids
    below ``max_seqs`` requests (32 streams with 32 spare ids: 31 ran a step, the last after
    them). An id costs two logits rows of host memory (1 MiB each at a 262k vocabulary)."""
    return max(0, min(max(32, max_seqs + 8), MAX_SEQ_IDS - max_seqs))


@dataclass(frozen=True)
class DeviceDefaults:
    """What 0 (the default) means for the step's size and the KV pool on one kind of device.

    CPU: steps of 512 tokens computed at once (a larger micro-batch did not pay on CPU), prompt
    chunks of 256 so decoding rows keep their pace while prompts prefill, and a pool of 16k
    tokens. GPU: llama-server's 2048-token batch in 512-token micro-batches, chunks of 512 (four
    prefilling prompts fill a step), and the pool the model's training context as free VRAM
    allows (0 here; see engine/vram.py and kv/sizing.py)."""

    n_batch: int
    n_ubatch: int  # 0: n_batch
    chunk_size: int
    pool_blocks: int


# The prefix cache's blocks a CPU engine with host memory for prefixes (``cache_ram``) keeps in
# the KV when ``prefix_cache_blocks`` is 0; the rest moves to host memory. Each cached cell slows
# every decode (llama.cpp attends over all of them): 4,064 tokens cost 5.5% at 8 streams here
# (benchmarks/cached_kv_cost.py), 1,024 about 1.4%, and a served bench with new prompts ran 4%
# faster keeping 8 blocks than 64 (README, 2026-12-05), while bringing a prefix back from host
# memory costs ~8 ms a thousand tokens more than finding it in the KV. On a GPU that cost is not
# measured yet: the whole pool stays.
CPU_RESIDENT_BLOCKS = 8
CPU_DEFAULTS = DeviceDefaults(n_batch=512, n_ubatch=0, chunk_size=256, pool_blocks=1024)
GPU_DEFAULTS = DeviceDefaults(n_batch=2048, n_ubatch=512, chunk_size=512, pool_blocks=0)


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter to load with the model: requests name it (as their ``model``, or in
    ``lora``) and run under it at ``scale`` unless they give their own."""

    name: str
    path: str
    scale: float = 1.0

    def __post_init__(self) -> None:
        check_lora_name(self.name)
        if not self.path:
            raise ValueError(f"LoRA adapter '{self.name}' needs a path")
        if not isinstance(self.scale, (int, float)) or isinstance(self.scale, bool) \
                or not abs(self.scale) <= MAX_LORA_SCALE:
            raise ValueError(f"LoRA adapter '{self.name}': scale must be a number in "
                             f"[-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}] (got {self.scale!r})")

    @staticmethod
    def parse(text: str) -> "LoraSpec":
        """``NAME=PATH[:SCALE]`` (``--lora``): a last ``:`` part that is a number is the
        scale, so paths with colons work too."""
        name, sep, rest = text.partition("=")
        if not sep or not rest:
            raise ValueError(f"--lora takes NAME=PATH[:SCALE] (got {text!r})")
        path, colon, tail = rest.rpartition(":")
        scale = 1.0
        try:
            scale = float(tail) if colon else scale
        except ValueError:
            colon = ""
        return LoraSpec(name.strip(), os.path.expanduser(path if colon else rest), scale)


# Options whose values are auto, on or off: YAML 1.1 reads a bare on or off as a boolean.
_ON_OFF_OPTIONS = frozenset({"flash_attn", "repack"})


def yaml_on_off(option: str, value: Any) -> Any:
    """A YAML file's value for ``option`` (``flash_attn`` or ``flash-attn``): a boolean where
    the option takes ``on``/``off`` is that word (``flash-attn: on`` was refused as True)."""
    if isinstance(value, bool) and option.replace("-", "_") in _ON_OFF_OPTIONS:
        return "on" if value else "off"
    return value


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """A YAML file, parsed safely, with a key given twice in one mapping refused (PyYAML keeps
    the last without a word: a models.yaml with two entries of one name lost the first, as a
    second ``max-loaded`` did the first). Any problem is a one-line ValueError: the file
    cannot be read, or what is wrong in it and where."""
    import yaml

    class _Unique(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            try:
                twice = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: construct_mapping says so
                continue
            if twice:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key '{key}' is given twice", key_node.start_mark)
        return loader.construct_mapping(node)

    _Unique.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_Unique)  # noqa: S506 (a SafeLoader)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:  # (the message named neither the file nor the problem)
        raise ValueError(f"{path} is not a UTF-8 text file") from None
    except yaml.YAMLError as e:
        raise ValueError(_yaml_problem(path, e)) from None


def _yaml_problem(path: object, e: Exception) -> str:
    """A YAML parse error as one line: what is wrong and where (PyYAML's own message spans
    several lines, with a copy of the offending line)."""
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
    problem = getattr(e, "problem", None) or " ".join(str(e).split())
    return f"{path} is not valid YAML: {problem}{where}"


_LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/@+-]{0,127}")


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, a container's cpuset,
    a test worker's share), where ``os.cpu_count()`` counts the whole machine; llama.cpp's
    threads beyond the mask would only wait for each other."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity masks on this platform (macOS)
        return os.cpu_count() or 1


def check_lora_name(name: str) -> None:
    """An adapter name is a model id clients send: letters, digits and ``._/@+-``."""
    if not isinstance(name, str) or not _LORA_NAME.fullmatch(name):
        raise ValueError(f"LoRA adapter name {name!r}: use letters, digits and ._/@+- "
                         "(at most 128 characters, starting with a letter or digit)")


def _gpu_default() -> bool:
    """JUSTLLM_GPU=1 means --gpu, for the CLI (Typer reads it) and for engines built in Python
    (the test suite and benchmarks on a GPU machine: benchmarks/gpu_check.sh sets it)."""
    return os.environ.get("JUSTLLM_GPU", "").lower() in ("1", "true", "yes")


def _check_kv_default() -> bool:
    """JUSTLLM_CHECK_KV=1 turns the engine's KV consistency check on (the test suite does)."""
    return os.environ.get("JUSTLLM_CHECK_KV", "") not in ("", "0")


def _spec_setting_uses(method: SpecMethod | None) -> tuple[tuple[str, str, bool, str], ...]:
    """(setting, its flag, whether ``method`` uses it, what it is for) for each of
    speculation's settings, each meant for some methods only (check_spec_settings)."""
    return (("gamma", "--gamma", method is not None, "--spec"),
            ("branch", "--branch", method is not None and method.tree, "--spec tree"),
            ("draft_p_min", "--draft-p-min", method is not None and method.draft_model,
             "--spec draft or tree: a draft model's cut-off"))


def unused_spec_settings(method: SpecMethod | None) -> tuple[str, ...]:
    """The speculation settings ``method`` (None: no speculation) does nothing with."""
    return tuple(name for name, _, used, _ in _spec_setting_uses(method) if not used)


def check_spec_settings(spec: str, method: SpecMethod | None, given: Iterable[str]) -> None:
    """Refuse each speculation setting in ``given`` that ``method`` (the one ``spec`` names;
    None and "" for none) does nothing with: it would be taken and change nothing."""
    given = set(given)
    for name, flag, used, meant in _spec_setting_uses(method):
        if name in given and not used:
            raise ValueError(f"{flag} is for {meant}, " + (
                f"not --spec {spec}" if spec else "and no --spec is given"))


# embeddings' pooling (EngineConfig.pooling); "rank": a reranker's score (llama-server's)
POOLINGS = ("mean", "cls", "last", "rank")
AUTO_ON_OFF = ("auto", "on", "off")  # --flash-attn, --repack


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; CLI flags map one to one onto these fields.

    ``pool_blocks * block_size`` is the KV pool in tokens and the llama.cpp context size, shared
    by all sequences. Zero in ``pool_blocks``, ``n_batch``, ``chunk_size`` and ``n_ubatch``
    means the default for the device (:data:`CPU_DEFAULTS`, :data:`GPU_DEFAULTS`), settled
    here, but for a GPU's pool, which the engine sizes from free VRAM once it knows the model
    (engine/vram.py); until then ``pool_blocks`` stays 0. ``ctx`` caps one request (prompt +
    output); 0 means the smaller of the pool and the model's training context.
    ``spare_seq_ids`` are llama.cpp sequence ids above ``max_seqs`` kept for features that
    need extra ids (prefix-cache holders, speculation); -1: :func:`default_spare_seq_ids`.
    ``prefix_cache`` shares KV between requests with a common prefix (radix tree).
    """

    model: str | None = None
    max_seqs: int = 32
    pool_blocks: int = 0
    block_size: int = 16
    chunk_size: int = 0
    max_prefill: int = 8
    max_decode: int = 32
    n_batch: int = 0
    # llama.cpp's micro-batch and flash attention (auto | on | off: auto lets llama.cpp use it
    # where the device supports it).
    n_ubatch: int = 0
    flash_attn: str = "auto"
    # llama.cpp's repacked weight layouts on the CPU (its "extra buffer types": AMX tiles,
    # interleaved Q4_0/Q4_K blocks): auto | on | off. auto is on but where llama.cpp's CPU
    # backend was built with AMX, whose path crashes the first decode on some Intel Xeons
    # (engine/backend.py ``repack_weights``).
    repack: str = "auto"
    max_queue: int = 256
    threads: int = 0
    ctx: int = 0
    gpu: bool = field(default_factory=_gpu_default)
    spare_seq_ids: int = -1
    prefix_cache: bool = True
    # cap on blocks the prefix cache keeps; 0: the whole pool (CPU_RESIDENT_BLOCKS on a CPU with
    # cache_ram)
    prefix_cache_blocks: int = 0
    # MiB of host memory for prefixes past that cap (kv/host_cache.py); 0: none, -1: no limit.
    # llama-server's default; with it a CPU engine keeps CPU_RESIDENT_BLOCKS of idle prefixes
    # in the KV unless prefix_cache_blocks says otherwise (engine/engine.py ``_spill``).
    cache_ram: int = 8192
    # Named policies: admission order and preemption victim (core/policy.py: "fcfs" or
    # "priority"), and which cached prefix goes first (kv/radix_cache.py: "lru" or "clock").
    scheduling_policy: str = "fcfs"
    eviction_policy: str = "lru"
    # Speculative decoding: "" (off) or a name in ``spec_methods``: spec/methods.py's (ngram,
    # draft, tree), or with plugins every registered one (Plugins.spec_methods).
    spec: str = ""
    spec_methods: Mapping[str, SpecMethod] = field(default_factory=lambda: SPEC_METHODS,
                                                   compare=False, repr=False)
    draft_model: str | None = None
    gamma: int = 4  # most draft tokens per request and step
    branch: int = 2  # tree: candidates at each of the first levels
    draft_p_min: float = 0.0  # draft model: stop drafting below this top-token probability
    # How chats become prompts: a built-in template name (engine/chat_template.py) or a Jinja
    # file; None: the model's own, or a plain transcript for a model without one.
    chat_template: str | None = None
    verbose: bool = False
    # After each step's KV operations, compare every sequence id's cells in llama.cpp with what
    # the scheduler and prefix cache believe (core/kv_view.py); a difference raises at once.
    check_kv: bool = field(default_factory=_check_kv_default)
    # LoRA adapters loaded with the model; whether clients may load and unload more at run
    # time; and how many consecutive steps one adapter set may take while another has work
    # (core/lora_groups.py: llama.cpp applies adapters per context, one set per step).
    lora: tuple[LoraSpec, ...] = ()
    lora_runtime: bool = False
    lora_max_steps: int = 4
    # How embeddings pool a sequence's token states: "" the model's own (its GGUF's pooling
    # type, as llama-server reads it: mean, CLS or the last token; mean for a model that names
    # none, such as a chat model), or one of POOLINGS (llama-server's --pooling).
    pooling: str = ""
    # How a reasoning model's thinking is returned (llama-server's --reasoning-format): "auto"
    # or "deepseek" apart from the answer (``reasoning_content``, Ollama's ``thinking``...),
    # "none" left in the answer's text. A request may choose otherwise.
    reasoning_format: str = "auto"
    # Tokens a reasoning model may think before its end tag is forced (llama-server's
    # --reasoning-budget): -1 no limit, 0 none. A request may choose otherwise.
    reasoning_budget: int = -1
    # Text forced before the end tag when a budget runs out (llama-server's
    # --reasoning-budget-message), so the model reads why its thinking stopped. A request may
    # give its own.
    reasoning_budget_message: str = ""
    # Fill-in-the-middle prompts with the suffix first (SUF suffix PRE prefix MID), as
    # llama-server's --spm-infill lays them out for models trained that way.
    spm_infill: bool = False
    # llama-server's --backend-sampling: plain requests' tokens are chosen inside llama.cpp's
    # decode graph, on the device (engine/graph_sampling.py says which requests qualify).
    backend_sampling: bool = False

    def __post_init__(self) -> None:
        # (the Python API's callers can pass anything: "no" was a true gpu, 1.5 threads a
        # TypeError deep in the load, NaN a context that fitted every request)
        for name in ("gpu", "prefix_cache", "verbose", "check_kv", "lora_runtime", "spm_infill",
                     "backend_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False (got {getattr(self, name)!r})")
        for name in ("threads", "ctx", "spare_seq_ids", "prefix_cache_blocks", "cache_ram",
                     "reasoning_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer (got {value!r})")
        for name in ("pool_blocks", "chunk_size", "n_batch", "n_ubatch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: the default; got {value!r})")
        # (its buffers hold a logits row per token: 10**9 asked for 119 GiB)
        if self.n_batch > MAX_N_BATCH:
            raise ValueError(f"n_batch must be at most {MAX_N_BATCH} (got {self.n_batch})")
        device = GPU_DEFAULTS if self.gpu else CPU_DEFAULTS
        n_batch = self.n_batch or device.n_batch
        object.__setattr__(self, "n_batch", n_batch)
        # Defaults give way to an explicit --n-batch below them.
        object.__setattr__(self, "chunk_size", self.chunk_size or min(device.chunk_size, n_batch))
        object.__setattr__(self, "n_ubatch", self.n_ubatch or min(device.n_ubatch or n_batch,
                                                                  n_batch))
        if not self.pool_blocks and not self.gpu:
            object.__setattr__(self, "pool_blocks", device.pool_blocks)
        if self.n_ubatch > self.n_batch:
            raise ValueError(f"n_ubatch ({self.n_ubatch}) must be <= n_batch ({self.n_batch})")
        positive = ("max_seqs", "block_size", "max_prefill", "max_decode", "lora_max_steps",
                    "max_queue")  # (a queue of 0 would refuse every request)
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        if self.flash_attn not in AUTO_ON_OFF:
            raise ValueError(f"flash_attn must be auto, on or off (got {self.flash_attn!r})")
        if self.repack not in AUTO_ON_OFF:
            raise ValueError(f"repack must be auto, on or off (got {self.repack!r})")
        spares_chosen = self.spare_seq_ids != -1
        if not spares_chosen:
            object.__setattr__(self, "spare_seq_ids", default_spare_seq_ids(self.max_seqs))
        for name in ("threads", "ctx", "spare_seq_ids", "prefix_cache_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.threads > MAX_THREADS:
            raise ValueError(f"--threads must be at most {MAX_THREADS}, ggml's GGML_MAX_N_THREADS "
                             f"(got {self.threads})")
        if self.pool_blocks * self.block_size > MAX_POOL_TOKENS:
            raise ValueError(f"--pool-blocks {self.pool_blocks} x --block-size {self.block_size} "
                             f"is {self.pool_blocks * self.block_size} tokens; a KV pool may "
                             f"have at most {MAX_POOL_TOKENS} (llama.cpp's context size is 32-bit)")
        if not isinstance(self.cache_ram, int) or self.cache_ram < -1:
            raise ValueError(f"cache_ram must be -1 (no limit), 0 (off) or MiB (got "
                             f"{self.cache_ram!r})")
        if self.max_seqs + self.spare_seq_ids > MAX_SEQ_IDS:
            # (spare ids left to their default give way first: then only max_seqs is over)
            what, got = (("max_seqs + spare_seq_ids", self.max_seqs + self.spare_seq_ids)
                         if spares_chosen else ("max_seqs", self.max_seqs))
            raise ValueError(f"{what} must be <= {MAX_SEQ_IDS}, got {got} (llama.cpp's 256 "
                             "sequence ids, each with a twin on sliding-window models)")
        if self.chunk_size > self.n_batch:
            raise ValueError(f"chunk_size ({self.chunk_size}) must be <= n_batch ({self.n_batch})")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                             f" (got {self.scheduling_policy!r})")
        if self.pooling not in ("", *POOLINGS):
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)} (got "
                             f"{self.pooling!r})")
        if not isinstance(self.reasoning_budget, int) or self.reasoning_budget < -1:
            raise ValueError(f"reasoning_budget must be -1 (no limit) or a number of tokens "
                             f"(got {self.reasoning_budget!r})")
        if not isinstance(self.reasoning_budget_message, str):
            raise ValueError("reasoning_budget_message must be a string")
        if self.reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)} "
                             f"(got {self.reasoning_format!r})")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}"
                             f" (got {self.eviction_policy!r})")
        if self.spec and self.spec not in self.spec_methods:
            raise ValueError(f"spec must be one of {', '.join(self.spec_methods)} "
                             f"(got {self.spec!r})")
        if self.spec_method is not None and self.spec_method.draft_model and not self.draft_model:
            raise ValueError(f"--spec {self.spec} needs --draft-model (a small GGUF with the "
                             "same vocabulary: make one with `justllm draft make`, or pass the "
                             "model itself)")
        if self.draft_model and not (self.spec_method and self.spec_method.draft_model):
            raise ValueError(f"--draft-model is for a method that drafts with it (--spec draft "
                             f"or tree), not {'--spec ' + self.spec if self.spec else 'none'}")
        if self.backend_sampling and self.spec:
            raise ValueError("--backend-sampling does not combine with --spec (a draft's "
                             "rows are verified against their logits)")
        # (integers: the Python API took gamma=2.5, and a tree of 2.5 levels was sized)
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) \
                or not 1 <= self.gamma <= MAX_DRAFT:
            raise ValueError(f"gamma must be an integer in [1, {MAX_DRAFT}] (got {self.gamma!r})")
        if isinstance(self.branch, bool) or not isinstance(self.branch, int) \
                or not 1 <= self.branch <= 4:
            raise ValueError(f"branch must be an integer in [1, 4] (got {self.branch!r})")
        if isinstance(self.draft_p_min, bool) or not isinstance(self.draft_p_min, (int, float)) \
                or not 0.0 <= self.draft_p_min <= 1.0:
            raise ValueError(f"draft_p_min must be in [0, 1] (got {self.draft_p_min!r})")
        # Speculation's settings without the method they set (each was taken and did nothing;
        # a request's speculative.p_min on an n-gram server was already a 400). Here a value
        # other than the default counts as given; the CLI knows what was typed (cli/options.py).
        fields = type(self).__dataclass_fields__
        check_spec_settings(self.spec, self.spec_method,
                            [n for n, *_ in _spec_setting_uses(None)
                             if getattr(self, n) != fields[n].default])
        if self.chat_template is not None and (not isinstance(self.chat_template, str)
                                               or not self.chat_template.strip()):
            raise ValueError("chat_template must be a template name or a file path")
        object.__setattr__(self, "lora", tuple(self.lora))
        if not all(isinstance(x, LoraSpec) for x in self.lora):
            raise ValueError("lora must be LoraSpec entries (LoraSpec.parse('NAME=PATH'))")
        names = [x.name for x in self.lora]
        if len(set(names)) != len(names):
            raise ValueError(f"a LoRA adapter name is given twice: {', '.join(names)}")

    @property
    def spec_method(self) -> SpecMethod | None:
        return self.spec_methods.get(self.spec) if self.spec else None

    @property
    def max_draft_nodes(self) -> int:
        """Draft tokens one request may put in a step (0 without speculation)."""
        m = self.spec_method
        return m.max_nodes(self.gamma, self.branch) if m is not None else 0

    @property
    def n_outputs(self) -> int:
        """Logits rows one step may need (llama.cpp reserves its output head for this many)."""
        base = max(self.max_seqs + self.max_prefill, 64)
        if not self.spec:
            return base
        # Each row reserves a vocabulary-wide output buffer (1 MiB for a 262k vocabulary), so
        # the rows for drafts are capped; the scheduler cuts drafts to fit.
        wanted = self.max_decode * (self.max_draft_nodes + 1) + self.max_prefill
        return min(self.n_batch, max(base, min(wanted, MAX_SPEC_OUTPUTS)))

    @property
    def pool_tokens(self) -> int:
        if not self.pool_blocks:
            raise ValueError("the KV pool of a --gpu engine is sized from free VRAM when the "
                             "engine starts (engine/vram.py); it has no size before that")
        return self.pool_blocks * self.block_size

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_seqs=self.max_seqs, max_prefill=self.max_prefill, max_decode=self.max_decode,
            chunk_size=self.chunk_size, n_batch=self.n_batch, max_queue=self.max_queue,
            n_seq_ids=self.max_seqs + (self.spare_seq_ids
                                       if self.prefix_cache or (self.spec_method is not None
                                                                and self.spec_method.tree)
                                       else 0),
            # (no padded rows with backend sampling: a sequence then has one output row)
            max_outputs=self.n_outputs,
            row_multiple=1 if self.gpu or self.backend_sampling else CPU_ROW_MULTIPLE,
            # (llama.cpp's CPU flash attention; backend sampling reads its rows by index)
            split_decodes_at=(0 if self.gpu or self.backend_sampling or self.flash_attn == "off"
                              else CPU_FA_QUERY_TILE),
            policy=self.scheduling_policy, lora_max_steps=self.lora_max_steps)


def physical_memory() -> int | None:
    """The machine's physical memory in bytes (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_pool_memory(config: EngineConfig, kv_bytes_per_token: int,
                      memory_bytes: int | None = None,
                      memory_is: str = "of memory this machine has") -> None:
    """Refuse, before anything is allocated, a KV pool whose cache alone is larger than
    ``memory_bytes`` (default: the machine's physical memory): llama.cpp would go on until the
    kernel's OOM killer ended the process (``--pool-blocks 99999999`` was killed at 23 GB).
    ``kv_bytes_per_token``: the model's (``ModelShape.kv_bytes_per_token``, its GGUF header),
    plus a draft model's. A ``--gpu`` pool not given yet (0) is sized from free VRAM later."""
    if not config.pool_blocks or kv_bytes_per_token <= 0:
        return
    memory = physical_memory() if memory_bytes is None else memory_bytes
    need = config.pool_tokens * kv_bytes_per_token
    if memory is not None and need > memory:
        raise ValueError(
            f"--pool-blocks {config.pool_blocks}: a KV pool of {config.pool_tokens} tokens needs "
            f"{need / 2**30:,.1f} GiB ({kv_bytes_per_token} bytes a token), more than the "
            f"{memory / 2**30:,.1f} GiB {memory_is}")
