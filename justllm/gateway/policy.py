"""The gateway's decisions, as pure functions over plain values: which idle model to unload,
when an idle model expires, and how long to wait before restarting a runner. (Ollama's
``keep_alive`` is read by ``server/ollama.py: keep_alive_seconds``, for both servers.)"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

MAX_FAILURES = 3  # consecutive failed starts before a model is reported failed


@dataclass(frozen=True)
class Loaded:
    """What the policies need to know of one loaded model."""

    name: str
    active: int  # requests in flight (or waiting for it to load)
    last_used: float  # when its last request ended (or it loaded)
    ttl: float  # idle seconds before it unloads; < 0 never
    memory: int = 0  # estimated bytes (memory_estimate)


def lora_request(body: dict, adapters: Collection[str]) -> bool:
    """The request runs under a LoRA adapter: it names one as its ``model``, or lists some in
    llama-server's ``lora`` field. Such a request is not disaggregated (PD): its KV is the
    adapter's, and prefill replicas refuse it."""
    return body.get("model") in adapters or bool(body.get("lora"))


def unstable_lora_id(body: dict, fixed: int) -> int | None:
    """The first adapter id in the ``lora`` field that replicas may not agree on, or None.
    Every replica loads models.yaml's ``fixed`` adapters first, in order, so ids below that
    name the same adapter everywhere; adapters loaded at run time get the next ids in the
    order each replica loaded them, which a restart or a late start changes (a request by id
    then ran under another adapter on another replica)."""
    entries = body.get("lora")
    for entry in entries if isinstance(entries, list) else ():
        value = entry.get("id") if isinstance(entry, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= fixed:
            return value
    return None


def unstable_lora_id_message(lora_id: int, model: str, fixed: int) -> str:
    """Why a request's ``lora`` id (``unstable_lora_id``) is refused."""
    which = (f"is not one of models.yaml's adapters of '{model}' (ids 0-{fixed - 1}, the same "
             "on every replica)" if fixed else
             f"names no adapter: '{model}' has none in models.yaml")
    return (f"lora: id {lora_id} {which}; an adapter loaded at run time has its own id on "
            'each replica: choose it by name ({"name": ...})')


def start_key(flags: dict[str, object], gpu: int | None) -> str | None:
    """Which runners must start one after another: a ``--gpu`` runner without a pool size
    sizes its KV pool from the GPU's free memory as it starts, so two starting at once on one
    GPU would both count the same memory (the later one's context allocation then fails).
    The key names the GPU (``CUDA_VISIBLE_DEVICES``, or every GPU the runner sees); None:
    start at once."""
    if not flags.get("gpu") or flags.get("pool-blocks"):
        return None
    return "all" if gpu is None else str(gpu)


def gpu_for_new(gpus: Sequence[int], held: Collection[int]) -> int:
    """The GPU of a replica the autoscaler adds beside replicas on the GPUs ``held`` (one
    entry per replica): the first slot of ``gpus`` none of them fills, taking the list round
    again as ``gpus[i % len]`` does. By index, the replicas added after others were retired
    piled up (ids only grow: 0 and 2 of ``[0, 1]`` both went to GPU 0, GPU 1 idle)."""
    left = Counter(held)
    for gpu in itertools.cycle(gpus):
        if left[gpu] <= 0:
            return gpu
        left[gpu] -= 1
    raise ValueError("no gpus")


def expired(models: list[Loaded], now: float) -> list[str]:
    """Idle models whose time to live has passed."""
    return [m.name for m in models
            if m.active == 0 and m.ttl >= 0 and now - m.last_used >= m.ttl]


def to_unload_for(models: list[Loaded], max_loaded: int, loading: int = 1,
                  max_memory: int = 0, need: int = 0) -> list[str] | None:
    """The least recently used idle models to unload so ``loading`` more models (``need``
    bytes in all) fit under ``max_loaded`` and ``max_memory`` (0: no limit); ``None`` when
    unloading every idle one is not enough (the caller waits for a model to go idle)."""
    count, used = len(models), sum(m.memory for m in models)

    def fits() -> bool:
        return ((max_loaded == 0 or count + loading <= max_loaded)
                and (max_memory == 0 or used + need <= max_memory))

    victims: list[str] = []
    for m in sorted((m for m in models if m.active == 0), key=lambda m: m.last_used):
        if fits():
            break
        victims.append(m.name)
        count, used = count - 1, used - m.memory
    return victims if fits() else None


# What a runner holds beyond its weights, KV cache and logits: Python, Litestar, llama.cpp's
# compute buffers (measured: a demo-model runner's RSS minus those three, 190-230 MiB).
RUNTIME_OVERHEAD = 256 * 2**20


def memory_estimate(file_bytes: int, pool_tokens: int, kv_bytes_per_token: int,
                    logit_rows: int, n_vocab: int) -> int:
    """A runner's memory: the weights (the file), an F16 KV cache for the whole pool, the
    float32 logits buffer, and the runtime. An estimate, on the safe side (sliding-window
    layers are counted as full)."""
    return (file_bytes + pool_tokens * kv_bytes_per_token + logit_rows * n_vocab * 4
            + RUNTIME_OVERHEAD)


# A runner not answering within this long (or load-timeout, if longer) counts as a failed
# start. It is not load-timeout itself: that is how long a request waits, and the load goes
# on without the request (a model may take longer to load than a client cares to wait).
RUNNER_START_LIMIT = 600.0


def start_limit(load_timeout: float) -> float:
    return max(load_timeout, RUNNER_START_LIMIT)


def restart_delay(failures: int) -> float | None:
    """Seconds before starting a runner again after ``failures`` consecutive failures
    (exponential: 0.5, 1, 2 s); None once there have been MAX_FAILURES."""
    if failures >= MAX_FAILURES:
        return None
    return 0.5 * 2 ** max(0, failures - 1) if failures else 0.0


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.I)


def parse_size(value: object) -> int:
    """Bytes from ``8GB``, ``512MiB``, ``1.5G`` or a number of bytes (GB = 10^9, GiB = 2^30)."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or such as '8GB' or '512MiB'")
    if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
        # (0.5 became 0, which max-memory reads as no limit)
        raise ValueError(f"{value!r} is not a whole number of bytes (or write it such as "
                         "'1.5GB')")
    if isinstance(value, (int, float)) and 0 <= value < math.inf:  # (int(inf) raised)
        return int(value)
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"{value!r} is not a size (bytes, or such as '8GB' or '512MiB')")
    unit = (m.group(2) or "b").lower()
    power = "bkmgt".index(unit[0])
    base = 1024 if "i" in unit else 1000
    size = float(m.group(1)) * base ** power
    if not math.isfinite(size):  # 400 digits
        raise ValueError(f"{value!r} is not a size (too large)")
    return int(size)


CHARS_PER_TOKEN = 4  # the usual estimate for English text under BPE/SentencePiece vocabularies
# The requests a PD model hands over from a prefill to a decode replica (the others, such as
# embeddings, are served whole).
PD_PATHS = ("/v1/chat/completions", "/v1/completions")


def prompt_tokens_estimate(body: dict, text: str) -> int:
    """A request's prompt length in tokens as the gateway (which has no tokenizer) can guess
    it: exact for a prompt given as token ids, else ``text`` (what routing matches) at
    :data:`CHARS_PER_TOKEN` characters a token. Used only to keep short prompts off the
    prefill replicas of a disaggregated model."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of token-id prompts: its first, as routing does
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return -(-len(text) // CHARS_PER_TOKEN)


def session_key(header: str | None, body: dict) -> str | None:
    """What keeps a client's requests on one replica (sticky sessions, so its prefix cache
    keeps serving it): the ``X-Session-Id`` header, else the body's ``prompt_cache_key``
    (OpenAI's hint for exactly this), ``user``, ``safety_identifier`` (OpenAI's newer name for
    ``user``) or Anthropic's ``metadata.user_id``; None when none is a string."""
    metadata = body.get("metadata")
    for key in (header, body.get("prompt_cache_key"), body.get("user"),
                body.get("safety_identifier"),
                metadata.get("user_id") if isinstance(metadata, dict) else None):
        if isinstance(key, str) and key:
            return key
    return None
