"""The only module that imports llama_cpp.

A thin owning wrapper over llama.cpp's C API for one model and one multi-sequence context:
every request is a sequence id in one unified KV cache, and one ``llama_decode`` computes a
batch mixing all of them. Every call that would abort the whole process on bad input (docs/llama-cpp-facts.md:
too many tokens for ``n_batch``, too many output rows, a sequence id out of range) is checked
here first and raised as an exception instead; C error codes become exceptions too.

Thread rule (docs/llama-cpp-facts.md): only one OS thread may run llama.cpp compute (``decode``), or the
OpenMP build slows down badly. Tokenizing from another thread is fine.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

import numpy as np

from justllm.engine import openmp

with openmp.short_spin() as _OPENMP_SLEEPS:  # (a constant: how libgomp loaded, once)
    from llama_cpp import llama_cpp as C  # noqa: E402  (the one llama_cpp import)
    from llama_cpp import llama_grammar as _grammar  # noqa: E402

from justllm.config import MAX_THREADS, usable_cpus
from justllm.core.fim import FimTokens
from justllm.core.gbnf import GBNF_TEXT
from justllm.engine.int_range import bounded_integer, integer_bounds, integer_rule
from justllm.engine.json_regex import json_text_pattern, raw_text_pattern
from justllm.engine.schema_rewrite import (
    SchemaConflict,
    check_valid_schema,
    constrains,
    hoist_refs,
    rewrite,
    root_refs,
)
from justllm.errors import (
    EngineClosedError,
    EngineError,
    GPUUnavailableError,
    GrammarDeadEndError,
    InvalidRequestError,
    LoadCancelled,
    ModelLoadError,
)
from justllm.models.gguf import read_gguf_header

# llama.cpp's JSON grammar (json_object), its number's exponent cut to two digits as a
# schema's is (_FINITE_NUMBER): it allowed 16 (1e999999), which no strict parser reads.
JSON_GRAMMAR: str = _grammar.JSON_GBNF.replace("[0-9] [1-9]{0,15})? ws", "[0-9] [0-9]?)? ws")

MAX_MEMORY_SEQ_ID = 256  # memory functions abort the process at or above this id


# The sink :func:`_log_to` set for the thread it runs on. llama.cpp's log callback is one for
# the whole process and is called on the thread that logs, so a call's lines are told apart by
# thread: the callbacks stay the two below for good, and a line goes to the sink of its own
# thread, if that thread has one. (A callback made for one call and set from a prepare
# worker, a grammar's compile, was freed when the call ended while the engine thread, inside
# llama_decode, could still be calling it: a segfault; and until then the engine thread's
# lines went to the grammar's sink.)
_thread_sink = threading.local()


def _own_sink(level: int, text: bytes) -> bool:
    sink = getattr(_thread_sink, "sink", None)
    if sink is None:
        return False
    sink(level, text.decode("utf-8", "replace"))
    return True


def _drop_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp log sink for non-verbose runs: only errors reach stderr."""
    if not _own_sink(level, text) and level == 4:  # GGML_LOG_LEVEL_ERROR (ggml.h: NONE,
        os.write(2, text)                           # DEBUG, INFO, WARN, ERROR, CONT)


def _whole_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp log sink for ``verbose`` runs: every line to stderr, as llama.cpp's own
    default does (these bindings do not take NULL for it)."""
    if not _own_sink(level, text):
        os.write(2, text)


# A C callback must outlive every call into llama.cpp, so it lives at module level (immutable).
_QUIET_LOG = C.llama_log_callback(_drop_log)
_VERBOSE_LOG = C.llama_log_callback(_whole_log)


def _usual_log(verbose: bool) -> Any:
    return _VERBOSE_LOG if verbose else _QUIET_LOG


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[Callable[[], bool]]:
    """Ctrl-C during a long llama.cpp call made on the main thread (a model load, a
    quantization): held until the call returns, then raised as KeyboardInterrupt. Python runs
    a signal's handler at the next Python code, and during such a call that is one of our C
    callbacks (the log sink, load progress); a KeyboardInterrupt raised there is printed and
    dropped by ctypes, and the command carried on. Yields whether one came, so that a
    callback that can stop the work (load progress) stops it. Elsewhere (another thread, or a
    SIGINT handler not Python's own, such as the server's), nothing changes."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield lambda: False
        return
    came: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield lambda: bool(came)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if came:
            raise KeyboardInterrupt


def _progress(stop: Callable[[], bool]) -> Any:
    """A load-progress callback that stops the load once ``stop()`` (llama.cpp then returns no
    model). The caller keeps it alive for the load."""
    return C.llama_progress_callback(lambda progress, user_data: not stop())


@contextlib.contextmanager
def _log_to(sink: Callable[[int, str], None], verbose: bool = False) -> Iterator[None]:
    """Send the lines llama.cpp logs on this thread to ``sink(level, text)`` during a call
    whose reason for failing llama.cpp only logs (an adapter, a grammar or a quantization it
    refuses); other threads' lines (the engine thread's, in llama_decode) go on to the usual
    sink. Any thread may use it (see ``_thread_sink``)."""
    before = getattr(_thread_sink, "sink", None)
    _thread_sink.sink = sink
    C.llama_log_set(_usual_log(verbose), ctypes.c_void_p(0))
    try:
        yield
    finally:
        _thread_sink.sink = before


def _kept(lines: list[tuple[int, str]], verbose: bool) -> Callable[[int, str], None]:
    """A log sink for :func:`_log_to` that keeps every line in ``lines`` (and, ``verbose``,
    prints it as the usual sink would)."""
    def sink(level: int, text: str) -> None:
        lines.append((level, text))
        if verbose:
            os.write(2, text.encode())
    return sink


def _load_failure(path: str, lines: list[tuple[int, str]]) -> str:
    """One line for a model llama.cpp would not load, with its reason (:func:`_load_reason`)
    or "corrupt or unsupported GGUF" when it gave none."""
    reason = _load_reason(lines)
    if reason is None:
        return f"llama.cpp could not load {path} (corrupt or unsupported GGUF)"
    return f"llama.cpp could not load {path}: {reason}"


def _load_reason(lines: list[tuple[int, str]]) -> str | None:
    """Why llama.cpp failed a model's load (a tensor of the wrong shape, a missing tensor, an
    unknown architecture), from its log: it only logs the reason."""
    reasons = [t.split("error loading model:", 1)[1] for level, t in lines
               if level == 4 and "error loading model:" in t]
    return re.sub(r"\s+", " ", reasons[0]).strip() if reasons else None


def load_problem(path: str) -> str | None:
    """Why llama.cpp would not load the model at ``path`` (None: it loads): it is loaded on the
    CPU, its tensors created against its metadata (each one's shape checked, none missing)
    and memory-mapped, not read, then freed. (``no_alloc`` would skip the mapping too, but
    llama.cpp asserts against it in the load that follows the tensors' checks.)"""
    C.llama_backend_init()
    mparams = C.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_extra_bufts = False  # no repacked copies of the weights (they read them)
    lines: list[tuple[int, str]] = []
    with _log_to(_kept(lines, False)):
        model = C.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        return _load_reason(lines) or "corrupt or unsupported GGUF"
    C.llama_model_free(model)
    return None


def _errors_of(lines: list[tuple[int, str]]) -> str:
    """The last error llama.cpp logged, on one line, without its function-name prefix."""
    errors = [t.strip() for level, t in lines if level == 4 and t.strip()]
    text = errors[-1] if errors else "no reason given"
    return re.sub(r"^\w+: ", "", text)


class KVCacheFullError(EngineError):
    """``llama_decode`` found no room in the KV cache for the batch (return code 1)."""


# Sequence ids one token of a batch may belong to (the leaves under a speculative tree node).
MAX_SEQS_PER_TOKEN = 16


@dataclass(frozen=True)
class BackendConfig:
    model_path: str
    n_ctx: int
    n_batch: int = 512
    n_ubatch: int = 0  # tokens llama.cpp computes at once; 0: n_batch
    flash_attn: str = "auto"  # auto (llama.cpp decides per device) | on | off
    repack: str = "auto"  # the CPU's repacked weight layouts: auto | on | off (repack_weights)
    n_seq_max: int = 40
    n_outputs_max: int = 64
    n_threads: int = 0  # 0: every core in the affinity mask (config.usable_cpus)
    gpu: bool = False
    verbose: bool = False
    # Keep every cell of a sliding-window model's KV until it is removed on purpose (twin
    # sequence ids, see LlamaBackend). Needed wherever KV is shared or handed on (prefix cache,
    # speculation's rollback); costs twice the sequence ids.
    keep_swa_cells: bool = False
    # The caller has just checked ``model_path`` with read_gguf_header (``justllm serve``'s
    # fail-fast read, before it binds its port): not read again (~100 ms on the demo model).
    model_checked: bool = False
    # Asked during the load, which stops once it answers True (LoadCancelled): a server that
    # shuts down while its model loads on another thread waits for that thread, and should
    # not wait for the whole load. llama.cpp asks between tensors, not while it reads the
    # vocabulary.
    cancel: Callable[[], bool] | None = field(default=None, compare=False)


# The sampler steps with graph versions that GraphSampling chains, in the engine's own order
# for OpenAI-style requests (engine/sampler.py: top-k, then the tempered distribution's cuts).
GRAPH_STEPS = ("top_k", "temperature", "min_p", "top_p")
# llama.cpp checks a graph sampler against a probe row of 128k logits when it is set, and its
# top-k aborts the process (a GGML_ASSERT) for a k past the row: no larger top_k goes there.
GRAPH_TOP_K_MAX = 128 * 1024


@dataclass(frozen=True)
class GraphSampling:
    """A sampler chain llama.cpp runs inside the decode graph for one sequence
    (:meth:`LlamaBackend.set_graph_sampling`): the argmax at temperature 0, else ``order``'s
    steps (top_k, temperature, min_p, top_p: the cuts of the engine's own sampler, in its
    order; a request's ``samplers`` gives llama.cpp's) and a draw by llama.cpp's generator
    seeded ``seed``. With ``candidates``, no draw: the ``candidates`` most likely tokens and
    their probabilities under the whole row's softmax at ``temperature`` (> 0), for the host
    to draw from (:meth:`LlamaBackend.graph_candidates`; the other fields are not used)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    order: tuple[str, ...] = GRAPH_STEPS
    seed: int = 0
    candidates: int = 0
    segment: int = 0  # the candidates' slice width (0: the whole row)

    def check(self) -> None:
        if not (self.temperature >= 0.0 and 0.0 < self.top_p <= 1.0 and self.top_k >= 0
                and 0.0 <= self.min_p <= 1.0):
            raise EngineError("temperature must be >= 0, top_p in (0, 1], top_k >= 0 and "
                              "min_p in [0, 1]")
        if not set(self.order) <= set(GRAPH_STEPS):
            raise EngineError(f"no graph version of the sampler steps {self.order}")
        if self.candidates and not (0 < self.candidates <= min(self.segment or GRAPH_TOP_K_MAX,
                                                               GRAPH_TOP_K_MAX)
                                    and self.temperature > 0.0 and self.segment >= 0):
            raise EngineError(f"candidates must be in [1, {GRAPH_TOP_K_MAX}], at most a "
                              "segment, at a temperature above 0")

    def chain(self) -> list[Any]:
        """New llama.cpp samplers, in chain order (the chain frees them)."""
        if self.temperature == 0.0:
            return [C.llama_sampler_init_greedy()]
        steps: list[Any] = []
        for step in self.order:
            if step == "top_k" and self.top_k > 0:
                steps.append(C.llama_sampler_init_top_k(self.top_k))
            elif step == "temperature":
                steps.append(C.llama_sampler_init_temp(self.temperature))
            elif step == "min_p" and self.min_p > 0.0:
                steps.append(C.llama_sampler_init_min_p(self.min_p, 1))
            elif step == "top_p" and self.top_p < 1.0:
                steps.append(C.llama_sampler_init_top_p(self.top_p, 1))
        steps.append(C.llama_sampler_init_dist(self.seed & 0xFFFFFFFF))
        return steps


_GGML_TYPE_I32 = 26  # enum ggml_type
# _CandidatesSampler's first stage: the best of each slice. On the demo model at temperature
# 0.8, 64 of 1024 left the 0.95 nucleus of 239 of 240 sampled rows decidable (16: 199, 32: 228).
SLICE_PICKS = 64


def most_candidates(n_vocab: int, segment: int) -> int:
    """The most candidates :class:`_CandidatesSampler` can take from a row of ``n_vocab``
    with ``segment``-wide slices (0: the whole row)."""
    if not segment or n_vocab <= segment:
        return n_vocab
    return min(SLICE_PICKS, segment) * -(-n_vocab // segment)


class _CandidatesSampler:
    """A llama.cpp sampler of our own for its experimental backend interface: inside the graph
    it takes the ``k`` most likely tokens of a row's softmax at ``temperature``, with their
    probabilities, and draws nothing. The context copies out those ids and probabilities
    instead of the 262k-wide row, and the probabilities are the row's own, so the host can
    draw from a nucleus exactly whenever every token of it beats the most a token left out
    can weigh (:meth:`LlamaBackend.graph_candidates` gives that bound).

    ggml's top-k (no sort of the row on the CPU) picks them from the whole row, or, with
    ``segment``, in two stages: the ``SLICE_PICKS`` best of each ``segment``-wide slice, then
    the ``k`` best of those. ggml's CUDA top-k sorts a row longer than 1024 whole where CUB's
    own top-k is missing (CUDA before 13.1), while slices of 1024 sort in shared memory, all
    at once; what the first stage leaves out weighs at most the largest of the slices' least
    picks, which comes out as one more probability after the ``k``.

    The callbacks run inside ``llama_decode`` (graph building, and llama.cpp's probe when a
    chain is set), building ggml nodes; this object keeps them, and the interface they make,
    alive while a chain holds a sampler made from it."""

    def __init__(self, k: int, temperature: float, segment: int = 0) -> None:
        lib, vp, i64, f32, i = C._lib, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self.k, self.scale, self.segment = k, 1.0 / temperature, segment
        fn = ctypes.CFUNCTYPE
        # fresh ctypes function objects (setting argtypes on lib's shared ones would change
        # them for every other user of the library)
        self._nelements = fn(i64, vp)(("ggml_nelements", lib))
        self._reshape_1d = fn(vp, vp, vp, i64)(("ggml_reshape_1d", lib))
        self._reshape_2d = fn(vp, vp, vp, i64, i64)(("ggml_reshape_2d", lib))
        self._reshape_3d = fn(vp, vp, vp, i64, i64, i64)(("ggml_reshape_3d", lib))
        self._pad = fn(vp, vp, vp, i, i, i, i)(("ggml_pad", lib))
        self._arange = fn(vp, vp, f32, f32, f32)(("ggml_arange", lib))
        self._cast = fn(vp, vp, vp, i)(("ggml_cast", lib))
        self._scale = fn(vp, vp, vp, f32)(("ggml_scale", lib))
        self._argmax = fn(vp, vp, vp)(("ggml_argmax", lib))
        self._concat = fn(vp, vp, vp, vp, i)(("ggml_concat", lib))
        self._top_k = fn(vp, vp, vp, i)(("ggml_top_k", lib))
        self._soft_max = fn(vp, vp, vp, vp, f32, f32)(("ggml_soft_max_ext", lib))
        self._get_rows = fn(vp, vp, vp, vp)(("ggml_get_rows", lib))
        self._label = ctypes.create_string_buffer(b"justllm-candidates")
        self._callbacks = (
            fn(vp, C.llama_sampler_p_ctypes)(lambda smpl: ctypes.addressof(self._label)),
            C.llama_sampler_i_apply(lambda smpl, cur_p: None),  # (never drawn on the host)
            C.llama_sampler_i_backend_init(lambda smpl, buft, n_out: True),
            C.llama_sampler_i_backend_apply(self._apply),
        )
        name, apply, init, backend_apply = self._callbacks
        self.iface = C.llama_sampler_i(
            name=ctypes.cast(name, C.llama_sampler_i_name), apply=apply, backend_init=init,
            backend_apply=backend_apply)

    def new(self) -> Any:
        """A new llama.cpp sampler of this kind (a chain that holds it frees it)."""
        return C.llama_sampler_init(ctypes.byref(self.iface), None)

    def _gather(self, ctx: int, values: int, picks: int, width: int, rows: int) -> int:
        """``values`` (``rows`` rows of ``width``) at each row's ``picks`` (indices within
        the row), as ggml gathers rows of width 1 batch by batch."""
        return self._get_rows(ctx, self._reshape_3d(ctx, values, 1, width, rows), picks)

    def _apply(self, smpl: Any, ctx: int, gf: int, data_p: Any) -> None:
        data = data_p.contents
        n = self._nelements(data.logits)
        probs = self._soft_max(ctx, self._reshape_1d(ctx, data.logits, n), None, self.scale,
                               0.0)
        ids = self._arange(ctx, 0.0, float(n), 1.0)  # (float32: exact below 2**24)
        bound = None
        if self.segment and n > self.segment:
            width, picks = self.segment, min(SLICE_PICKS, self.segment)
            slices = -(-n // width)
            if slices * width > n:  # a padded last slice: zeros, never a nucleus token
                probs = self._pad(ctx, probs, slices * width - n, 0, 0, 0)
                ids = self._pad(ctx, ids, slices * width - n, 0, 0, 0)
            best = self._top_k(ctx, self._reshape_2d(ctx, probs, width, slices), picks)
            picked = self._gather(ctx, probs, best, width, slices)  # [1, picks, slices]
            ids = self._reshape_1d(ctx, self._gather(ctx, ids, best, width, slices),
                                   picks * slices)
            # the bound: the largest of the slices' least picks (ggml has argmax, no min)
            least = self._argmax(ctx, self._scale(ctx, self._reshape_2d(
                ctx, picked, picks, slices), -1.0))
            least = self._gather(ctx, picked, self._reshape_2d(ctx, least, 1, slices), picks,
                                 slices)  # [1, 1, slices]
            top = self._argmax(ctx, self._reshape_2d(ctx, least, slices, 1))
            bound = self._gather(ctx, least, self._reshape_2d(ctx, top, 1, 1), slices, 1)
            probs, n = self._reshape_1d(ctx, picked, picks * slices), picks * slices
        best = self._top_k(ctx, probs, self.k)
        picked = self._reshape_1d(ctx, self._gather(ctx, probs, best, n, 1), self.k)
        if bound is not None:
            picked = self._concat(ctx, picked, self._reshape_1d(ctx, bound, 1), 0)
        data.probs = picked
        data.candidates = self._reshape_1d(ctx, self._cast(ctx, self._gather(
            ctx, ids, best, n, 1), _GGML_TYPE_I32), self.k)
        data.logits = None  # (no row copied out)


_GBNF_RULE = re.compile(r"^([A-Za-z0-9-]+)\s*::=", re.M)


# A GBNF body's pieces, for splitting it at its top-level "|": literals and classes whole.
_GBNF_PIECE = re.compile(f'{GBNF_TEXT.pattern}|[()|]|[^"\\[#()|]+')


def _alternatives(body: str) -> list[str]:
    """``body``'s top-level alternatives (``a | (b | c) d`` -> ``a``, ``(b | c) d``), its
    comments left out."""
    out, piece, depth = [], "", 0
    for m in _GBNF_PIECE.finditer(body):
        text = m.group(0)
        if text.startswith("#"):
            continue
        depth += (text == "(") - (text == ")")
        if text == "|" and depth == 0:
            out.append(piece.strip())
            piece = ""
        else:
            piece += text
    return [*out, piece.strip()]


def without_trailing_space(gbnf: str) -> str:
    """``gbnf`` with no whitespace allowed after its top-level value. llama-cpp-python's JSON
    grammars end every value with an optional space (``ws``/``space``), the top one too, so a
    model could end a JSON answer with a space (or a newline) before it stopped; OpenAI's
    structured outputs end at the closing brace. Each of the root's alternatives loses its
    last ``ws``/``space``, one that names a rule through a copy of it (``NAME-top``; an anyOf
    root's alternatives, a type list's, any value's) made the same way; what ends otherwise
    stays. A grammar without a root is returned as it is."""
    starts = list(_GBNF_RULE.finditer(gbnf))
    spans = {m.group(1): (m.start(), m.end(), starts[i + 1].start() if i + 1 < len(starts)
                          else len(gbnf)) for i, m in enumerate(starts)}
    if "root" not in spans:
        return gbnf
    added: dict[str, str] = {}  # NAME -> NAME-top's body

    def trimmed(name: str, depth: int) -> str | None:
        """``name``'s body without its trailing space, or None when nothing changes."""
        _, start, end = spans[name]
        alternatives = _alternatives(gbnf[start:end])
        out = [_trim(a, depth) for a in alternatives]
        return None if out == alternatives else " | ".join(out)

    def _trim(alternative: str, depth: int) -> str:
        cut = re.search(r"\s(?:ws|space)$", alternative)
        if cut is not None:
            return alternative[:cut.start()].strip()
        if alternative in spans and depth < 8:  # (a name: its copy, once made)
            if f"{alternative}-top" not in added:
                body = trimmed(alternative, depth + 1)
                if body is None:
                    return alternative
                added[f"{alternative}-top"] = body
            return f"{alternative}-top"
        return alternative

    root = trimmed("root", 0)
    if root is None:
        return gbnf
    r_start, _, r_end = spans["root"]
    tops = "".join(f"{name} ::= {body}\n" for name, body in added.items())
    return f"{gbnf[:r_start]}root ::= {root}\n{gbnf[r_end:]}" + ("\n" + tops if tops else "")


# A JSON string's character without the control characters JSON forbids raw (llama-cpp-python's
# converter allowed them, so a schema's strings could hold a raw newline: invalid JSON; the
# current llama.cpp converter excludes them the same way).
_JSON_ESCAPE = r'"\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | ' + _JSON_ESCAPE
# The most a schema may ask a rule repeated (minLength, maxItems, a pattern's {n,m}): the
# converter nests one group per repetition, and llama.cpp refuses ~1,000 ("exceeds sane
# defaults") and overflows its stack at ~100,000 (a 9-byte maxLength killed the server).
MAX_SCHEMA_REPEAT = 1000
# The most alternatives a grammar may offer (a client's `|`, a choice list, an enum, anyOf):
# its mask costs about the live alternatives times the vocabulary, on the engine thread.
MAX_GRAMMAR_ALTERNATIVES = 1024
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"),
           ("minProperties", "maxProperties"))
_REPEATS = tuple(name for pair in _BOUNDS for name in pair)
_PATTERN_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def check_schema_shape(schema: Any, where: str = "schema") -> None:
    """InvalidRequestError for a schema whose grammar would be too big for llama.cpp (see
    ``MAX_SCHEMA_REPEAT``, ``MAX_GRAMMAR_ALTERNATIVES``) or that no value can match (an empty
    ``enum``, a minimum over its maximum: the grammar would admit nothing, and llama.cpp
    cannot even parse an empty alternative), naming the keyword and where it is."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema_shape(item, f"{where}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    for low, high in _BOUNDS:
        least, most = schema.get(low), schema.get(high)
        if isinstance(least, int) and isinstance(most, int) and least > most:
            raise InvalidRequestError(f"{where}: {low} {least} is more than {high} {most}, so "
                                      "no value matches")
    for key, value in schema.items():
        at = f"{where}.{key}"
        if key in ("enum", "anyOf", "oneOf") and value == []:
            raise InvalidRequestError(f"{at} is empty, so no value matches")
        if key in _REPEATS and isinstance(value, int) and value > MAX_SCHEMA_REPEAT:
            raise InvalidRequestError(f"{at} is {value}; at most {MAX_SCHEMA_REPEAT} here (the "
                                      "grammar repeats a rule that many times)")
        if key == "pattern" and isinstance(value, str):
            for m in _PATTERN_COUNT.finditer(value):
                if max(int(m.group(1)), int(m.group(2) or 0)) > MAX_SCHEMA_REPEAT:
                    raise InvalidRequestError(f"{at}: {m.group(0)} repeats more than "
                                              f"{MAX_SCHEMA_REPEAT} times")
        if key == "enum" and isinstance(value, list) and len(value) > MAX_GRAMMAR_ALTERNATIVES:
            raise InvalidRequestError(f"{at} has {len(value)} values; at most "
                                      f"{MAX_GRAMMAR_ALTERNATIVES}")
        if key in ("anyOf", "oneOf") and isinstance(value, list) and (
                len(value) > MAX_GRAMMAR_ALTERNATIVES):
            raise InvalidRequestError(f"{at} has {len(value)} schemas; at most "
                                      f"{MAX_GRAMMAR_ALTERNATIVES}")
        check_schema_shape(value, at)


# A pattern's "." in a JSON string's text: any character but a line break, raw or escaped
# (llama-cpp-python's was any character but a line break, raw: a quote or a backslash ended
# or broke the string, and a tab was invalid JSON).
_JSON_DOT = r'[^"\\\x7F\x00-\x1F] | "\\" ["\\/bft]'
_GBNF_LITERAL_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


# The longest property name an additional key is kept from repeating (_not_keys).
_NOT_KEYS_CHARS = 64


# llama-cpp-python's number, its exponent cut to two digits: it allowed 16 (1e400), which no
# client's JSON parser reads as a number (a tool call's arguments were then malformed).
_FINITE_NUMBER = '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? [0-9] [0-9]?)? space'


# A real calendar date: llama-cpp-python's took any day 01-31 in any month (2023-02-31);
# February 29th only in a leap year (a multiple of 4 whose last two digits are not 00, or of
# 400).
_DATE = ('[0-9] [0-9] [0-9] [0-9] "-" ( ( "0" [13578] | "1" [02] ) "-" '
         '( "0" [1-9] | [12] [0-9] | "3" [01] ) | ( "0" [469] | "11" ) "-" '
         '( "0" [1-9] | [12] [0-9] | "30" ) | "02-" ( "0" [1-9] | "1" [0-9] | "2" [0-8] ) ) | '
         '( [0-9] [0-9] ( "0" [48] | [2468] [048] | [13579] [26] ) | '
         '( "0" [048] | [2468] [048] | [13579] [26] ) "00" ) "-02-29"')


class _SchemaConverter(_grammar.SchemaConverter):
    """llama-cpp-python's converter, plus integer bounds (engine/int_range.py), JSON's own
    string characters (no raw control characters), real dates, and what it got wrong: literals with a
    backslash or a character past U+FFFF (an enum value, a property name), a pattern's JSON
    escaping (engine/json_regex.py), objects with optional properties beside
    ``additionalProperties``, ``prefixItems`` with ``items`` or a count, schemas that only
    annotate (any value), and keywords it passed over beside ``type`` lists, ``anyOf``,
    ``$ref`` and ``allOf`` (engine/schema_rewrite.py)."""

    def _add_primitive(self, name: str, rule: Any) -> str:
        if name == "char":
            rule = _grammar.BuiltinRule(_JSON_CHAR, [])
        elif name == "number":  # an exponent of at most two digits: always a finite double
            rule = _grammar.BuiltinRule(_FINITE_NUMBER, list(rule.deps))
        elif name == "date":  # (date-time's too)
            rule = _grammar.BuiltinRule(_DATE, [])
        return super()._add_primitive(name, rule)

    def _add_rule(self, name: str, rule: str) -> str:
        if name == "dot" and rule in (_grammar.DOT, _grammar.DOTALL):
            rule = _JSON_DOT
        return cast(str, super()._add_rule(name, rule))

    def _format_literal(self, literal: str) -> str:
        return '"' + "".join(_GBNF_LITERAL_ESCAPES.get(c) or (
            f"\\x{ord(c):02X}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
            for c in literal) + '"'

    def _generate_constant_rule(self, value: Any) -> str:
        return self._format_literal(json.dumps(value, ensure_ascii=False))

    def _visit_pattern(self, pattern: str, name: str) -> str:
        return cast(str, super()._visit_pattern(json_text_pattern(pattern), name))

    def visit(self, schema: Any, name: str) -> str:
        schema = rewrite(schema, self._refs.__getitem__)
        rule_name = name + "-" if name in _grammar.RESERVED_NAMES else name or "root"
        if not constrains(schema):
            return self._add_rule(rule_name, self._add_primitive(
                "value", _grammar.PRIMITIVE_RULES["value"]))
        if bounded_integer(schema):
            return self._add_rule(rule_name, integer_rule(*integer_bounds(schema)))
        if isinstance(schema.get("items"), list):  # an old draft's tuple, as a new one's:
            # (the converter wrote every position, past a maxItems, short of a minItems)
            rest = {k: v for k, v in schema.items() if k not in ("items", "additionalItems")}
            more = schema.get("additionalItems")
            schema = {**rest, "prefixItems": schema["items"],
                      **({"items": more} if isinstance(more, dict) else {})}
        if schema.get("type") in (None, "array") and schema.get("prefixItems"):
            return self._add_rule(rule_name, self._tuple_rule(schema, name))
        return cast(str, super().visit(schema, name))

    def _tuple_rule(self, schema: dict[str, Any], name: str) -> str:
        """An array of ``prefixItems`` (JSON Schema: each position optional unless
        ``minItems`` asks for it), then ``items`` (a schema; else no more items), within
        ``minItems``/``maxItems``."""
        prefix = f"{name}{'-' if name else ''}"
        least, most = int(schema.get("minItems", 0)), schema.get("maxItems")
        positions = schema["prefixItems"][:most]
        rules = [self.visit(item, f"{prefix}tuple-{i}") for i, item in enumerate(positions)]
        n, items, tail = len(rules), schema.get("items"), ""
        if isinstance(items, dict) and (most is None or most > n):
            item = self.visit(items, f"{prefix}item")
            extra_least = max(0, least - n)
            count = ("*" if not extra_least and most is None
                     else f"{{{extra_least},{'' if most is None else most - n}}}")
            tail = f'("," space {item}){count}'
            if extra_least:
                least = n
        elif least > n:
            raise SchemaConflict(f"minItems {least} asks for more items than prefixItems "
                                 "has, and there is no items schema for the rest")
        for i in reversed(range(min(least, n), n)):
            piece = f'"," space {rules[i]}' if i else rules[i]
            tail = f"({piece} {tail})?" if tail else f"({piece})?"
        head = ' "," space '.join(rules[:min(least, n)])
        return f'"[" space {head} {tail} "]" space'.replace("  ", " ")

    def _not_keys(self, keys: list[str]) -> str:
        """A JSON string (then space) that is none of ``keys``: an additional property's name
        must not repeat a named one (a duplicate key; llama.cpp's converter does the same).
        Follows the keys' text as a trie: at each point the string may leave it with another
        character, or end where no key ends. Keys JSON writes with an escape, and keys
        longer than :data:`_NOT_KEYS_CHARS` (the trie nests a group per character) are left
        out: rare names, which an additional key may then repeat."""
        texts = sorted({t for t in (json.dumps(k, ensure_ascii=False)[1:-1] for k in keys)
                        if "\\" not in t and len(t) <= _NOT_KEYS_CHARS})
        char = self._add_primitive("char", _grammar.BuiltinRule(_JSON_CHAR, []))

        def one(c: str) -> str:
            return c if c.isascii() and c.isalnum() else (
                f"\\x{ord(c):02X}" if ord(c) < 0x100 else f"\\u{ord(c):04X}"
                if ord(c) < 0x10000 else f"\\U{ord(c):08X}")

        def node(prefix: str) -> str:
            longer = [t for t in texts if t.startswith(prefix) and len(t) > len(prefix)]
            nexts = sorted({t[len(prefix)] for t in longer})
            alts = [f'"{one(c)}" {node(prefix + c)}' for c in nexts]
            alts.append(f'([^"\\\\\\x7F\\x00-\\x1F{"".join(one(c) for c in nexts)}] | '
                        f'{_JSON_ESCAPE}) {char}*')
            return f"({' | '.join(alts)}){'' if prefix in texts else '?'}"

        return f'"\\"" {node("")} "\\"" space'

    def _build_object_rule(self, properties: list[tuple[str, Any]], required: set[str],
                           name: str, additional_properties: Any) -> str:
        """The required properties in order, then each optional one at most once in order,
        then any number of additional ones (``additionalProperties``: true or a schema).
        llama-cpp-python's lost the comma after an optional property before additional ones,
        and wrote names past U+FFFF as surrogate escapes."""
        prefix = f"{name}{'-' if name else ''}"
        kv = {}
        for key, sub in properties:
            # (a property named "" made its value's rule "root": the whole grammar was its)
            value = self.visit(sub, f"{prefix}{key or 'empty-name'}")
            literal = self._format_literal(json.dumps(key, ensure_ascii=False))
            kv[key] = self._add_rule(f"{prefix}{key or 'empty-name'}-kv",
                                     f'{literal} space ":" space {value}')
        extra = None
        if additional_properties is True or isinstance(additional_properties, dict):
            value = self.visit({} if additional_properties is True else additional_properties,
                               f"{prefix}additional-value")
            key = (self._add_rule(f"{prefix}additional-key",
                                  self._not_keys([k for k, _ in properties])) if properties
                   else self._add_primitive("string", _grammar.PRIMITIVE_RULES["string"]))
            extra = self._add_rule(f"{prefix}additional-kv", f'{key} ":" space {value}')
        needed = [kv[k] for k, _ in properties if k in required]
        optional = [kv[k] for k, _ in properties if k not in required]
        # tails[i]: what may follow once optional[:i] are passed (each part after a comma);
        # rules, so that the grammar grows with the properties, not with their square
        tails = [f'("," space {extra})*' if extra else ""]
        for i in reversed(range(len(optional))):
            tails.insert(0, self._add_rule(f"{prefix}rest-{i}",
                                           f'("," space {optional[i]})? {tails[0]}'.strip()))
        if needed:
            body = ' "," space '.join(needed) + f" {tails[0]}"
        else:
            firsts = [f"{kv_rule} {tails[i + 1]}" for i, kv_rule in enumerate(optional)]
            if extra:
                firsts.append(f"{extra} {tails[-1]}")
            body = f"({' | '.join(f.strip() for f in firsts)})?" if firsts else ""
        return f'"{{" space {body} "}}" space'.replace("  ", " ")


def grammar_from_json_schema(schema: dict) -> str:
    """GBNF for JSON documents matching ``schema`` (llama-cpp-python's converter, as
    ``json_schema_to_gbnf`` runs it, with _SchemaConverter's additions and mends)."""
    check_valid_schema(schema)
    try:
        check_schema_shape(schema)
    except InvalidRequestError as e:
        raise InvalidRequestError(str(e), param="response_format") from None
    try:
        converter = _SchemaConverter(prop_order={}, allow_fetch=False, dotall=False,
                                     raw_pattern=False)
        # (resolve_refs rewrites in place: a copy)
        copy = hoist_refs(root_refs(json.loads(json.dumps(schema))))
        converter.visit(converter.resolve_refs(copy, "stdin"), "")
        return converter.format_grammar()
    except Exception as e:  # the converter raises plain exceptions on schemas it cannot handle
        raise InvalidRequestError(f"unsupported JSON schema: {e}",
                                  param="response_format") from e


def grammar_from_regex(pattern: str) -> str:
    """GBNF for text that ``pattern`` matches whole (vLLM's ``regex`` / ``guided_regex``):
    llama-cpp-python's converter in its raw mode, over engine/json_regex.py's translation
    (``\\d``, classes, groups, quantifiers; back-references and lookaround refused)."""
    if not pattern.strip("^$"):
        raise InvalidRequestError("the regular expression is empty", param="regex")
    try:
        converter = _grammar.SchemaConverter(prop_order={}, allow_fetch=False, dotall=False,
                                             raw_pattern=True)
        converter._visit_pattern(raw_text_pattern(pattern), "root")
        return cast(str, converter.format_grammar())
    except Exception as e:  # ValueError from the translation, AssertionError from the converter
        raise InvalidRequestError(f"unsupported regular expression: {e}",
                                  param="regex") from e


def _model_metadata(model) -> dict[str, str]:
    """A loaded model's GGUF key/values as strings (the vocabulary arrays left out)."""
    out: dict[str, str] = {}
    buf = ctypes.create_string_buffer(1 << 16)
    for i in range(int(C.llama_model_meta_count(model))):
        if C.llama_model_meta_key_by_index(model, i, buf, len(buf)) < 0:
            continue
        key = buf.value.decode("utf-8", "replace")
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "scores", "token_type", "merges")):
            continue
        if C.llama_model_meta_val_str_by_index(model, i, buf, len(buf)) >= 0:
            out[key] = buf.value.decode("utf-8", "replace")
    return out


def read_gguf_info(path: str) -> dict[str, str]:
    """A GGUF's metadata plus llama.cpp's one-line description (``desc``), reading only the
    header and vocabulary (no weights, no context). The header is checked whole first, as
    before a load: llama.cpp reading a vocabulary that lists a token twice aborts the process
    (models/gguf.py), and one bad file in a listing must not take the lister with it."""
    read_gguf_header(path)
    C.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))
    C.llama_backend_init()
    mparams = C.llama_model_default_params()
    mparams.vocab_only = True
    model = C.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        raise ModelLoadError(f"llama.cpp could not read {path} (corrupt or unsupported GGUF)")
    try:
        out = _model_metadata(model)
        buf = ctypes.create_string_buffer(256)
        if C.llama_model_desc(model, buf, len(buf)) >= 0:
            out["desc"] = buf.value.decode("utf-8", "replace")
        template = C.llama_model_chat_template(model, None)
        if template:
            out["tokenizer.chat_template"] = template.decode("utf-8", "replace")
        return out
    finally:
        C.llama_model_free(model)


def repack_weights(setting: str) -> bool:
    """Whether llama.cpp may keep CPU weights in its repacked layouts ("extra buffer types":
    AMX tiles, interleaved quant blocks; llama-server's ``--no-repack`` turns them off).
    ``auto``: yes, unless its CPU backend was built with AMX. On an Intel Xeon with AMX
    (Sapphire Rapids and later; a native build uses it) the AMX path segfaults in the first
    decode of a Q4_K model on some machines: ggml-org/llama.cpp#20824, closed without a fix;
    Ollama users and dspy's CI met it. It did so with the demo model on this project's
    2-core Xeon (2026-12-04), where the plain layouts run."""
    if setting != "auto":
        return setting == "on"
    C.llama_backend_init()
    return b"AMX_INT8 = 1" not in C.llama_print_system_info()


def cores_idle_between_decodes() -> bool:
    """Whether llama.cpp's CPU threads leave their cores soon after a decode
    (engine/openmp.py), so the step's rows may be prepared on them."""
    return _OPENMP_SLEEPS


def gpu_offload_supported() -> bool:
    return bool(C.llama_supports_gpu_offload())


@dataclass(frozen=True)
class GpuDevice:
    name: str
    free_bytes: int
    total_bytes: int


_GGML_DEV_GPUS = (1, 2)  # enum ggml_backend_dev_type: CPU, GPU, IGPU, ACCEL (as llama.cpp's
# llama_supports_gpu_offload, an integrated GPU counts)
_FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type


def _ggml(name: str, restype: Any, *argtypes: Any) -> Any:
    """A ggml function of the bindings' library, declared (llama_cpp declares llama's own)."""
    fn = getattr(C._lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def gpu_devices() -> list[GpuDevice]:
    """The GPUs this llama.cpp build can use, with their free and total memory now (ggml's
    device registry; empty on a CPU-only build)."""
    p, size = ctypes.c_void_p, ctypes.c_size_t
    count, get = _ggml("ggml_backend_dev_count", size), _ggml("ggml_backend_dev_get", p, size)
    kind = _ggml("ggml_backend_dev_type", ctypes.c_int, p)
    describe = _ggml("ggml_backend_dev_description", ctypes.c_char_p, p)
    memory = _ggml("ggml_backend_dev_memory", None, p, ctypes.POINTER(size),
                   ctypes.POINTER(size))
    C.llama_backend_init()  # loads the backends into the registry
    out = []
    for i in range(count()):
        dev = get(i)
        if kind(dev) not in _GGML_DEV_GPUS:
            continue
        free, total = size(0), size(0)
        memory(dev, ctypes.byref(free), ctypes.byref(total))
        name = (describe(dev) or b"").decode("utf-8", "replace")
        out.append(GpuDevice(name, int(free.value), int(total.value)))
    return out


def gpu_backends() -> list[str]:
    """The GPU backends this llama.cpp build has (``CUDA``, ``Vulkan``...), whether or not
    they see a device: ggml's backend registry less the CPU's (and RPC's, which needs a
    server, and BLAS's, which computes on the CPU)."""
    p, size = ctypes.c_void_p, ctypes.c_size_t
    count, get = _ggml("ggml_backend_reg_count", size), _ggml("ggml_backend_reg_get", p, size)
    name = _ggml("ggml_backend_reg_name", ctypes.c_char_p, p)
    C.llama_backend_init()  # loads the backends into the registry
    names = [(name(get(i)) or b"").decode() for i in range(count())]
    return [n for n in names if n not in ("CPU", "RPC", "BLAS")]


def require_gpu_offload() -> None:
    """Say clearly, before loading anything, that this llama-cpp-python build has no GPU, or
    that it has a GPU backend that sees no device (llama.cpp's own check counts devices: a
    CUDA build without a visible GPU looks CPU-only to it)."""
    if not gpu_offload_supported():
        backends = gpu_backends()
        if backends:
            raise GPUUnavailableError(
                f"--gpu: this llama-cpp-python build has a GPU backend ({', '.join(backends)}) "
                "but sees no GPU (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)")
        raise GPUUnavailableError(
            "--gpu needs a llama-cpp-python built with a GPU backend; this one is CPU-only. "
            "Reinstall it with CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install --force-reinstall "
            "--no-cache-dir llama-cpp-python==0.3.36")


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _needs_model(method: _Method) -> _Method:
    """A method that reaches the model, context or vocabulary: after ``close`` (they are
    freed) an EngineClosedError, not a crash in llama.cpp."""
    @functools.wraps(method)
    def checked(self: LlamaBackend, *args: Any, **kwargs: Any) -> Any:
        if not self._model:
            raise EngineClosedError("the model is closed")
        return method(self, *args, **kwargs)

    return cast(_Method, checked)


class LlamaBackend:
    """One loaded model and one context with ``n_seq_max`` sequences in a unified KV cache.

    Twin sequences (``keep_swa_cells``, sliding-window models such as Gemma 3): llama.cpp's SWA
    cache, even at full size (``swa_full``), reuses a cell that only one sequence tags once the
    cell has slid out of that sequence's window, and then purges every lower position of that
    sequence. A prefix-cache holder or a running request whose prompt others will share loses
    its early cells that way, and a later ``seq_cp`` of them copies nothing: the receiving
    sequence is short, its next batch fails on "inconsistent sequence positions", or, where
    positions still line up, it attends to a partial window. A cell tagged by two sequences is
    never reused, so every sequence ``s`` has a twin ``s + n_seq_max`` that tags exactly the same
    cells: ``seq_rm``/``seq_cp`` act on both and every batch token is given both ids. Callers
    see only ``s``.
    """

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self._model = None
        self._ctx = None
        self._children: list[EmbeddingContext] = []
        self._loras: list[LoraAdapter] = []
        self._lora_set: tuple[tuple[LoraAdapter, float], ...] = ()
        # seq id -> (what it draws, its llama_sampler chain): set_graph_sampling
        self._graph_chains: dict[int, tuple[GraphSampling, object]] = {}
        # the interfaces of the candidate samplers made so far, by (k, temperature, segment)
        self._candidate_kinds: dict[tuple[int, float, int], _CandidatesSampler] = {}
        C.llama_log_set(_usual_log(config.verbose), ctypes.c_void_p(0))
        # Missing, not a GGUF, or shorter than its tensors: one clear error before llama.cpp
        # (which logs its own lines and then fails without saying why).
        if not config.model_checked:
            read_gguf_header(config.model_path)
        if config.gpu:
            require_gpu_offload()
        limit = MAX_MEMORY_SEQ_ID // 2 if config.keep_swa_cells else MAX_MEMORY_SEQ_ID
        if config.n_seq_max > limit:
            raise ValueError(f"at most {limit} sequences")

        C.llama_backend_init()
        mparams = C.llama_model_default_params()
        mparams.n_gpu_layers = -1 if config.gpu else 0
        mparams.use_extra_bufts = repack_weights(config.repack)
        lines: list[tuple[int, str]] = []
        try:
            with _ctrl_c_held() as interrupted, _log_to(_kept(lines, config.verbose),
                                                          config.verbose):
                cancel = config.cancel
                mparams.progress_callback = progress = _progress(
                    interrupted if cancel is None else lambda: interrupted() or cancel())
                self._model = C.llama_model_load_from_file(config.model_path.encode(), mparams)
                del progress
        except KeyboardInterrupt:
            self.close()
            raise
        if not self._model and config.cancel is not None and config.cancel():
            raise LoadCancelled(config.model_path)
        if not self._model:
            raise ModelLoadError(_load_failure(config.model_path, lines))
        self._vocab = C.llama_model_get_vocab(self._model)
        self.n_vocab = int(C.llama_vocab_n_tokens(self._vocab))
        self.n_embd = int(C.llama_model_n_embd(self._model))  # an embedding's size
        self._eog_ids: np.ndarray | None = None
        self.n_ctx_train = int(C.llama_model_n_ctx_train(self._model))
        self.n_swa = int(C.llama_model_n_swa(self._model))  # sliding window; 0: none
        swa = self.n_swa > 0
        self._twin = config.n_seq_max if config.keep_swa_cells and swa else 0

        threads = config.n_threads or min(usable_cpus(), MAX_THREADS)  # (ggml's most)
        cparams = C.llama_context_default_params()
        cparams.n_ctx = config.n_ctx
        cparams.n_batch = config.n_batch
        cparams.n_ubatch = min(config.n_ubatch or config.n_batch, config.n_batch)
        cparams.flash_attn_type = _FLASH_ATTN[config.flash_attn]
        cparams.n_seq_max = config.n_seq_max + self._twin
        # llama.cpp reserves an output row per sequence id at least (1 MiB each for a 262k
        # vocabulary), twins included; batches are still checked against config.n_outputs_max.
        cparams.n_outputs_max = max(config.n_outputs_max, config.n_seq_max + self._twin)
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = True
        cparams.swa_full = True  # else partial prefixes of SWA layers lose their early cells
        cparams.no_perf = True
        try:
            with _ctrl_c_held():
                self._ctx = C.llama_init_from_model(self._model, cparams)
        except KeyboardInterrupt:
            self.close()
            raise
        if not self._ctx:
            self.close()
            raise ModelLoadError(
                f"llama.cpp could not create a context of {config.n_ctx} tokens for "
                f"{config.model_path}")
        self._mem = C.llama_get_memory(self._ctx)
        self.n_ctx = int(C.llama_n_ctx(self._ctx))
        self.n_ubatch = int(C._lib.llama_n_ubatch(self._ctx))
        self.n_threads = int(C.llama_n_threads(self._ctx))
        self._pieces: dict[int, bytes] = {}
        # Time spent inside llama_decode, for benchmarks' "share of a step in Python".
        self.decode_seconds = 0.0
        self._init_batch(config.n_batch)

    # ---- the batch ------------------------------------------------------------------------

    def _init_batch(self, n: int) -> None:
        """A llama_batch over numpy arrays we own, so filling it is a numpy slice assignment."""
        self.batch_tokens = np.zeros(n, dtype=np.int32)
        self.batch_pos = np.zeros(n, dtype=np.int32)
        # Each token's sequence ids: column 0 is ``batch_seq``; a token shared by several
        # sequences (a node of a speculative tree) lists them and sets ``batch_n_seq``.
        self.batch_seqs = np.zeros((n, 2 * MAX_SEQS_PER_TOKEN), dtype=np.int32)
        self.batch_seq = self.batch_seqs[:, 0]
        self.batch_n_seq = np.ones(n, dtype=np.int32)
        self.batch_logits = np.zeros(n, dtype=np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base, row = self.batch_seqs.ctypes.data, self.batch_seqs.strides[0]
        self._seq_ptrs = (i32p * n)(*[ctypes.cast(base + row * i, i32p) for i in range(n)])
        self._batch = self._batch_from(0)

    @_needs_model
    def decode(self, n_tokens: int, split: int = 0) -> np.ndarray:
        """Decode the first ``n_tokens`` entries of the batch arrays; with ``split`` (0 <
        split < n_tokens), the first ``split`` in a llama_decode of their own, then the rest
        (core/scheduler.py ``split_decodes_at`` says why). Either way the batch's tokens all
        go in, or none do: when the second part fails, the first part's are taken out again.

        Returns the logits, one row per entry whose ``batch_logits`` flag is set, in batch
        order: a read-only view valid until the next ``decode`` (with a split, an array of
        its own).
        """
        cfg = self.config
        if not 0 < n_tokens <= cfg.n_batch:
            raise EngineError(f"batch of {n_tokens} tokens; must be 1..{cfg.n_batch}")
        toks = self.batch_tokens[:n_tokens]
        seqs = self.batch_seq[:n_tokens]
        n_out = int(np.count_nonzero(self.batch_logits[:n_tokens]))
        if n_out > cfg.n_outputs_max:
            raise EngineError(f"{n_out} output rows; at most {cfg.n_outputs_max}")
        if toks.min() < 0 or toks.max() >= self.n_vocab:
            raise EngineError("token id out of the vocabulary")
        n_seq = self.batch_n_seq[:n_tokens]
        if n_seq.min() < 1 or n_seq.max() > MAX_SEQS_PER_TOKEN:
            raise EngineError(f"each token needs 1..{MAX_SEQS_PER_TOKEN} sequence ids")
        if n_seq.max() > 1:  # the ids each token lists, not the unused columns
            seqs = self.batch_seqs[:n_tokens, :MAX_SEQS_PER_TOKEN][
                np.arange(MAX_SEQS_PER_TOKEN) < n_seq[:, None]]
        if seqs.min() < 0 or seqs.max() >= cfg.n_seq_max:
            raise EngineError("sequence id out of range")
        if self._twin:
            self._add_twins(n_tokens)
        if 0 < split < n_tokens and not self._graph_chains:  # (graph rows are read by index)
            return self._decode_split(n_tokens, split, n_out)
        self._llama_decode(self._batch, n_tokens)
        if n_out == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        if self._graph_chains:
            # llama.cpp copies no logits out when every sequence of every output row (twins
            # included) has a chain (its needs_raw_logits)
            out = self.batch_logits[:n_tokens] != 0
            ids = self.batch_seqs[:n_tokens][out]
            listed = np.arange(ids.shape[1]) < self.batch_n_seq[:n_tokens][out][:, None]
            if all(int(s) in self._graph_chains for s in ids[listed]):
                return np.empty((0, self.n_vocab), dtype=np.float32)
        return self._logits(n_out)

    def _logits(self, n_out: int) -> np.ndarray:
        ptr = C.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))

    def _llama_decode(self, batch: Any, n_tokens: int) -> None:
        batch.n_tokens = n_tokens
        t0 = time.perf_counter()
        rc = C.llama_decode(self._ctx, batch)
        self.decode_seconds += time.perf_counter() - t0
        if rc == 1:
            raise KVCacheFullError("no room in the KV cache for this batch")
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc}")

    def _decode_split(self, n_tokens: int, split: int, n_out: int) -> np.ndarray:
        flags = self.batch_logits[:n_tokens]
        first = int(np.count_nonzero(flags[:split]))
        out = np.empty((n_out, self.n_vocab), dtype=np.float32)
        self._llama_decode(self._batch, split)
        if first:
            out[:first] = self._logits(first)
        try:
            self._llama_decode(self._batch_from(split), n_tokens - split)
        except EngineError:
            self._take_out(split)
            raise
        if n_out > first:
            out[first:] = self._logits(n_out - first)
        return out

    def _batch_from(self, o: int) -> Any:
        """A llama_batch over the batch arrays from entry ``o`` on (0: the whole batch; a
        split decode's second part)."""
        i32p = ctypes.POINTER(ctypes.c_int32)
        b: Any = C.llama_batch()  # llama_cpp annotates its pointer fields as arrays
        b.token = ctypes.cast(self.batch_tokens.ctypes.data + 4 * o, i32p)
        b.embd = None
        b.pos = ctypes.cast(self.batch_pos.ctypes.data + 4 * o, i32p)
        b.n_seq_id = ctypes.cast(self.batch_n_seq.ctypes.data + 4 * o, i32p)
        b.seq_id = ctypes.cast(ctypes.addressof(self._seq_ptrs) + ctypes.sizeof(i32p) * o,
                               ctypes.POINTER(i32p))
        b.logits = ctypes.cast(self.batch_logits.ctypes.data + o,
                               ctypes.POINTER(ctypes.c_int8))
        return b

    def _take_out(self, n_tokens: int) -> None:
        """Remove what the first ``n_tokens`` entries of the batch put in the KV cache: each
        sequence they list (twins too) from its first position among them on. A step only
        ever adds a sequence's newest positions."""
        first: dict[int, int] = {}
        for i in range(n_tokens):
            pos = int(self.batch_pos[i])
            for s in self.batch_seqs[i, :self.batch_n_seq[i]]:
                first[int(s)] = min(pos, first.get(int(s), pos))
        for s, pos in first.items():
            C.llama_memory_seq_rm(self._mem, s, pos, -1)

    # ---- tokens chosen inside the graph (llama.cpp's backend sampling) ---------------------

    def set_tokens_in_graph(self, seq_ids: Sequence[int], temperature: float = 0.0,
                            top_p: float = 1.0, seed: int = 0, candidates: int = 0,
                            segment: int = 0) -> None:
        """Choose the next token of each of ``seq_ids`` inside the decode graph, and of no
        other sequence; ``[]`` turns it off. Temperature 0: the argmax; else a draw at
        ``temperature`` from the ``top_p`` nucleus of the tempered distribution (vLLM's order:
        temperature first), by a generator seeded ``seed`` + the sequence id; with
        ``candidates``, no draw: that many candidates (from each ``segment``-wide slice) and
        their probabilities at ``temperature`` (:meth:`graph_candidates`)
        (:meth:`set_graph_sampling` for each sequence's own chain).
        ``benchmarks/engine_throughput.py --raw`` uses it, to measure what reading whole
        262k-wide rows back and choosing on the CPU costs on a GPU against choosing there."""
        wanted = {int(s) for s in seq_ids}
        if any(not 0 <= s < self.config.n_seq_max for s in wanted):
            raise EngineError("sequence id out of range")
        specs: dict[int, GraphSampling | None] = {s: None for s in self._graph_chains
                                                  if s < self.config.n_seq_max}
        for s in wanted:
            specs[s] = (GraphSampling(temperature, top_p=top_p, seed=seed + s,
                                      candidates=candidates, segment=segment)
                        if temperature > 0.0 else GraphSampling())
        self.set_graph_sampling(specs)

    def set_graph_sampling(self, specs: Mapping[int, GraphSampling | None]) -> None:
        """Choose the next token of each sequence of ``specs`` inside the decode graph, on the
        device that holds the output layer, by its chain (None: no more; its rows' logits are
        read again); the other sequences keep what they have.

        llama.cpp's backend sampling (experimental in this llama.cpp): a decode whose output
        rows all belong to such sequences copies no logits out of the device, and ``decode``
        returns no rows; :meth:`graph_token` reads the tokens. A row of a batch with other
        rows is read as usual. A sequence with a chain may have one output row a batch. Each
        change makes llama.cpp reserve its graphs again (docs/llama-cpp-facts.md), so a chain
        that is set again unchanged is kept."""
        checked: dict[int, GraphSampling | None] = {}
        for s, spec in specs.items():
            if not 0 <= s < self.config.n_seq_max:
                raise EngineError("sequence id out of range")
            if spec is not None:
                spec.check()
                if spec.top_k >= self.n_vocab:  # no cut (llama.cpp's graph top-k aborts on it)
                    spec = replace(spec, top_k=0)
                if spec.top_k > GRAPH_TOP_K_MAX:
                    raise EngineError(f"a top_k over {GRAPH_TOP_K_MAX} cannot be chosen in the "
                                      "graph")
                if spec.candidates > most_candidates(self.n_vocab, spec.segment):
                    # (ggml's top-k aborts the process when asked for more than it is given)
                    raise EngineError(f"{spec.candidates} candidates are more than this "
                                      "vocabulary gives")
            checked[s] = spec
        for s, spec in sorted(checked.items()):
            # a twin is sampled with its sequence's chain: llama.cpp copies logits out for a
            # row any of whose sequences lacks one (the row is drawn by its first sequence's)
            for t in (s, s + self._twin) if self._twin else (s,):
                self._set_chain(t, spec)

    def _set_chain(self, s: int, spec: GraphSampling | None) -> None:
        old = self._graph_chains.get(s)
        if old is not None and old[0] == spec:
            return
        if old is not None:
            C.llama_set_sampler(self._ctx, s, None)
            C.llama_sampler_free(self._graph_chains.pop(s)[1])
        if spec is None:
            return
        # A fresh chain for each sequence: llama.cpp aborts when one is initialised twice.
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        if spec.candidates:
            key = (spec.candidates, spec.temperature, spec.segment)
            if key not in self._candidate_kinds:
                self._candidate_kinds[key] = _CandidatesSampler(*key)
            C.llama_sampler_chain_add(chain, self._candidate_kinds[key].new())
        else:
            for step in spec.chain():
                C.llama_sampler_chain_add(chain, step)
        if not C.llama_set_sampler(self._ctx, s, chain):
            C.llama_sampler_free(chain)
            raise EngineError("this llama.cpp build cannot choose tokens inside the graph")
        self._graph_chains[s] = (spec, chain)

    def graph_tokens(self, n_out: int) -> list[int]:
        """The tokens the last decode chose in the graph for its first ``n_out`` batch entries
        (each an output row of a sequence with a chain)."""
        return [self.graph_token(i) for i in range(n_out)]

    def graph_token(self, i: int) -> int:
        """The token the last decode chose in the graph for batch entry ``i`` (an output row of
        a sequence with a chain: :meth:`set_graph_sampling`)."""
        token = int(C.llama_get_sampled_token_ith(self._ctx, i))
        if not 0 <= token < self.n_vocab:
            raise EngineError("an output row was not chosen in the graph")
        return token

    def graph_candidates(self, i: int) -> tuple[np.ndarray, np.ndarray, float]:
        """The candidates the last decode took in the graph for batch entry ``i`` (an output row
        of a sequence whose chain has ``candidates``): their token ids and their probabilities
        under the whole row's softmax, in no particular order (copies), and the most a token
        left out of them can weigh."""
        n = int(C.llama_get_sampled_candidates_count_ith(self._ctx, i))
        n_probs = int(C.llama_get_sampled_probs_count_ith(self._ctx, i))
        ids_p = C.llama_get_sampled_candidates_ith(self._ctx, i)
        probs_p = C.llama_get_sampled_probs_ith(self._ctx, i)
        if not n or not ids_p or not probs_p or n_probs not in (n, n + 1):
            raise EngineError("an output row has no candidates from the graph")
        probs = np.ctypeslib.as_array(probs_p, shape=(n_probs,)).copy()
        # (two stages: the first stage's bound follows the candidates)
        bound = float(probs[:n].min()) if n_probs == n else max(float(probs[n]),
                                                                 float(probs[:n].min()))
        return np.ctypeslib.as_array(ids_p, shape=(n,)).astype(np.int32), probs[:n], bound

    def _add_twins(self, n_tokens: int) -> None:
        """Give each token of the batch the twins of its sequence ids too."""
        ids, n_seq = self.batch_seqs[:n_tokens], self.batch_n_seq[:n_tokens]
        if n_seq.max() == 1:
            ids[:, 1] = ids[:, 0] + self._twin
        else:
            for j in range(int(n_seq.max())):
                rows = np.flatnonzero(n_seq > j)
                ids[rows, n_seq[rows] + j] = ids[rows, j] + self._twin
        n_seq *= 2

    # ---- KV memory ------------------------------------------------------------------------

    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.config.n_seq_max:
            raise EngineError(f"sequence id {seq_id} out of range")

    @_needs_model
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        """Drop positions ``p0..p1`` (-1: open end) of a sequence from the KV cache."""
        self._check_seq(seq_id)
        ok = C.llama_memory_seq_rm(self._mem, seq_id, p0, p1)
        if self._twin:
            ok = C.llama_memory_seq_rm(self._mem, seq_id + self._twin, p0, p1) and ok
        if not ok:
            raise EngineError(f"could not remove positions {p0}..{p1} of sequence {seq_id}")

    @_needs_model
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Tag ``src``'s cells with ``dst`` too: zero-copy sharing in the unified cache."""
        self._check_seq(src)
        self._check_seq(dst)
        C.llama_memory_seq_cp(self._mem, src, dst, p0, p1)
        if self._twin:
            C.llama_memory_seq_cp(self._mem, src, dst + self._twin, p0, p1)

    @_needs_model
    def seq_pos_max(self, seq_id: int) -> int:
        """Highest position the sequence holds; -1 when it holds none."""
        self._check_seq(seq_id)
        return int(C.llama_memory_seq_pos_max(self._mem, seq_id))

    @_needs_model
    def seq_pos_min(self, seq_id: int) -> int:
        """Lowest position the sequence holds (in the sliding-window cache, where cells go
        first); -1 when it holds none."""
        self._check_seq(seq_id)
        return int(C.llama_memory_seq_pos_min(self._mem, seq_id))

    def seq_num_cells(self, seq_id: int) -> int | None:
        """Not exposed by llama.cpp (its state size is not linear in cells for SWA models)."""
        return None

    def twin_differs(self, seq_id: int) -> bool:
        """True when a sequence and its twin no longer tag the same positions (a bug)."""
        if not self._twin:
            return False
        twin = seq_id + self._twin
        return (C.llama_memory_seq_pos_min(self._mem, seq_id),
                C.llama_memory_seq_pos_max(self._mem, seq_id)) != (
                C.llama_memory_seq_pos_min(self._mem, twin),
                C.llama_memory_seq_pos_max(self._mem, twin))

    @_needs_model
    def seq_state(self, seq_id: int) -> bytearray:
        """The sequence's KV cells (positions, and keys and values of every layer) as llama.cpp
        serialises them."""
        self._check_seq(seq_id)
        size = int(C.llama_state_seq_get_size(self._ctx, seq_id))
        data = bytearray(max(size, 1))  # written in place: no copy out of a ctypes buffer
        view = (ctypes.c_uint8 * len(data)).from_buffer(data)
        written = int(C.llama_state_seq_get_data(self._ctx, view, size, seq_id))
        del view  # (a bytearray with an export cannot be resized)
        if written == 0 or written > size:
            raise EngineError(f"llama.cpp could not serialise sequence {seq_id}")
        del data[written:]
        return data

    @_needs_model
    def set_seq_state(self, seq_id: int, data: bytes | bytearray | memoryview) -> None:
        """Put serialised cells (``seq_state``'s) into an empty sequence. llama.cpp reports a
        bad buffer or no room as 0 bytes read (it checks as it reads, throwing inside, never
        aborting): the sequence is then emptied and EngineError raised."""
        self._check_seq(seq_id)
        n = len(data)
        # llama.cpp only reads it: a pointer to the caller's own bytes, not a copy of them
        view = np.frombuffer(data, dtype=np.uint8) if n else np.zeros(1, dtype=np.uint8)
        read = int(C.llama_state_seq_set_data(
            self._ctx, view.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n, seq_id))
        if read != n:
            self.seq_rm(seq_id)
            raise EngineError(f"llama.cpp refused the KV data ({read} of {n} bytes read: no "
                              "room in the KV cache, or data of another layout)")
        if self._twin:
            C.llama_memory_seq_cp(self._mem, seq_id, seq_id + self._twin, -1, -1)

    @_needs_model
    def clear_kv(self) -> None:
        C.llama_memory_clear(self._mem, True)

    # ---- vocabulary -----------------------------------------------------------------------

    @_needs_model
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True
                 ) -> list[int]:
        data = text.encode("utf-8", errors="replace")
        cap = len(data) + 16
        buf = (ctypes.c_int32 * cap)()
        n = C.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ctypes.c_int32 * cap)()
            n = C.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special,
                                 parse_special)
            if n < 0:
                raise EngineError("tokenization failed")
        return list(buf[:n])

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (control tokens render as nothing, or as their text with
        ``special``; only the first kind is cached: decoding asks for it every token)."""
        piece = None if special else self._pieces.get(token)
        if piece is None:
            if not self._model:
                raise EngineClosedError("the model is closed")
            buf = ctypes.create_string_buffer(64)
            n = C.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = C.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
            piece = buf.raw[:max(n, 0)]
            if not special:
                self._pieces[token] = piece
        return piece

    @_needs_model
    def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens`` as llama.cpp writes it back, special tokens as their text
        (``<bos>``), which is what vLLM's and llama-server's /detokenize give. Ids must be in
        the vocabulary (the caller checks)."""
        arr = (ctypes.c_int32 * max(len(tokens), 1))(*tokens)
        cap = 8 * len(tokens) + 16
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            n = C.llama_detokenize(self._vocab, arr, len(tokens), buf, cap, False, True)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", "replace")
            cap = -n
        raise EngineError("detokenization failed")

    @_needs_model
    def token_text(self, token: int) -> str:
        """A token's text in the vocabulary (SentencePiece's ``▁`` for a space), what a
        Hugging Face tokenizer's ``convert_ids_to_tokens`` gives."""
        return (C.llama_vocab_get_text(self._vocab, token) or b"").decode("utf-8", "replace")

    @_needs_model
    def eog_ids(self) -> np.ndarray:
        """Every end-of-generation token id (llama.cpp's set), found once by asking each id
        (~0.25 s on a 262k vocabulary: only ``min_tokens`` needs the list)."""
        if self._eog_ids is None:
            self._eog_ids = np.array([t for t in range(self.n_vocab)
                                      if C.llama_vocab_is_eog(self._vocab, t)], dtype=np.int64)
        return self._eog_ids

    @_needs_model
    def is_eog(self, token: int) -> bool:
        """An end-of-generation token (llama.cpp's set: EOS, EOT and the like). Asked per
        sampled token: a scan of the whole vocabulary at start cost 0.2-0.3 s."""
        return bool(C.llama_vocab_is_eog(self._vocab, token))

    @_needs_model
    def fim_tokens(self) -> FimTokens:
        """The model's fill-in-the-middle tokens, as llama.cpp reads them from the GGUF (or
        finds them by their text in the vocabulary)."""
        v = self._vocab

        def token(fn: Callable[[Any], int]) -> int | None:
            t = int(fn(v))
            return t if t >= 0 else None

        return FimTokens(token(C.llama_vocab_fim_pre), token(C.llama_vocab_fim_suf),
                         token(C.llama_vocab_fim_mid), token(C.llama_vocab_fim_rep),
                         token(C.llama_vocab_fim_sep))

    @_needs_model
    def end_of_turn(self) -> int:
        """The token an infill draw ends with when nothing else is likely (llama.cpp's: EOT,
        else EOS)."""
        eot = int(C.llama_vocab_eot(self._vocab))
        return eot if eot >= 0 else int(C.llama_vocab_eos(self._vocab))

    def adds_bos(self) -> int | None:
        """The BOS token if the model's prompts start with one, else None."""
        bos = int(C.llama_vocab_bos(self._vocab))
        return bos if bos >= 0 and C.llama_vocab_get_add_bos(self._vocab) else None

    @_needs_model
    def special_text(self, which: str) -> str:
        """The text of the BOS or EOS token ("bos" / "eos"), for chat templates."""
        token = C.llama_vocab_bos(self._vocab) if which == "bos" else C.llama_vocab_eos(self._vocab)
        if token < 0:
            return ""
        buf = ctypes.create_string_buffer(128)
        n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return buf.raw[:max(n, 0)].decode("utf-8", "replace")

    @_needs_model
    def vocab_fingerprint(self) -> str:
        """A hash of every token's text, type and the special ids: two models with the same
        fingerprint tokenize alike, so one can draft for the other."""
        import hashlib

        h = hashlib.sha256()
        v = self._vocab
        h.update(f"{self.n_vocab}:{C.llama_vocab_type(v)}:{C.llama_vocab_bos(v)}:"
                 f"{C.llama_vocab_eos(v)}:".encode())
        for t in range(self.n_vocab):
            h.update(C.llama_vocab_get_text(v, t) or b"")
            h.update(b"\0")
        return h.hexdigest()

    # ---- metadata -------------------------------------------------------------------------

    def metadata(self) -> dict[str, str]:
        return _model_metadata(self._model)

    @_needs_model
    def chat_template(self, name: str | None = None) -> str | None:
        """The GGUF's chat template (``tokenizer.chat_template``), or its template called
        ``name`` (``tokenizer.chat_template.NAME``: ``tool_use``); None where it has none."""
        raw = C.llama_model_chat_template(self._model, name.encode() if name else None)
        return raw.decode("utf-8", "replace") if raw else None

    @_needs_model
    def grammar(self, gbnf: str) -> "GrammarMatcher":
        """A token mask that follows a GBNF grammar (for structured output)."""
        return GrammarMatcher(self, gbnf)

    @_needs_model
    def grammar_error(self, gbnf: str) -> str | None:
        """Why llama.cpp refuses ``gbnf`` (its parser's reason, "unexpected end of input",
        or the log's; "" when it gives none), or None when it takes it: a client's grammar is
        checked before its request is queued. Reads only the vocabulary, so any thread may
        call it. The log and stderr are redirected for the call, from whichever thread (the
        engine thread's log lines in that moment are not printed: a small loss next to a
        client's reason)."""
        smpl, why = _grammar_sampler(self, gbnf)
        if smpl:
            C.llama_sampler_free(smpl)
        return why

    # ---- LoRA adapters --------------------------------------------------------------------

    @_needs_model
    def load_lora(self, path: str) -> "LoraAdapter":
        """Load a LoRA adapter GGUF for this model (``models/lora.py`` has checked what would
        abort the process). llama.cpp refuses one made for another model (architecture,
        tensor names or shapes): a ModelLoadError with its reason."""
        lines: list[tuple[int, str]] = []
        with _log_to(_kept(lines, False), self.config.verbose):
            handle = C.llama_adapter_lora_init(self._model, path.encode())
        if not handle:
            reason = _errors_of(lines).removeprefix("failed to apply lora adapter: ")
            raise ModelLoadError(f"LoRA adapter {path}: llama.cpp refused it: {reason}")
        adapter = LoraAdapter(handle, path)
        self._loras.append(adapter)
        return adapter

    @_needs_model
    def set_loras(self, adapters: tuple[tuple["LoraAdapter", float], ...]) -> None:
        """Apply these adapters, with their scales, to every following decode of the context
        (none: the base model). llama.cpp rebuilds its compute graph at the next decode."""
        n = len(adapters)
        if n:
            handles = (C.llama_adapter_lora_p_ctypes * n)(
                *[a.handle for a, _ in adapters])  # type: ignore[misc]  # handles: pointers
            scales = (ctypes.c_float * n)(*[s for _, s in adapters])
            C.llama_set_adapters_lora(self._ctx, handles, n, scales)
        else:
            C.llama_set_adapters_lora(self._ctx, None, 0, None)
        self._lora_set = adapters

    def free_lora(self, adapter: "LoraAdapter") -> None:
        """Free an adapter; the context stops using it first (llama.cpp keeps a pointer)."""
        if any(a is adapter for a, _ in self._lora_set):
            self.set_loras(())
        if adapter in self._loras:
            self._loras.remove(adapter)
            C.llama_adapter_lora_free(adapter.handle)

    def generates(self) -> bool:
        """Whether the model writes text: not an encoder (BERT and its kin, sentence-embedding
        models whose GGUF says their attention is not causal: they have no language-model
        head, and the "next tokens" llama.cpp computes for them mean nothing)."""
        meta = self.metadata()
        arch = meta.get("general.architecture", "")
        causal = meta.get(f"{arch}.attention.causal", "true").strip().lower() != "false"
        return causal and arch not in _ENCODER_ARCHS

    def embedding_pooling(self, asked: str = "") -> str:
        """How embeddings pool: ``asked`` (mean, cls, last), else the model's own pooling type
        (``{arch}.pooling_type`` in its GGUF, as llama-server reads it, when it is mean, CLS or
        last), else mean (a chat model names none: llama.cpp would pool nothing)."""
        if asked:
            return asked
        meta = self.metadata()
        own = meta.get(f"{meta.get('general.architecture', '')}.pooling_type", "")
        return {"1": "mean", "2": "cls", "3": "last", "4": "rank"}.get(own.strip(), "mean")

    @_needs_model
    def rerank_tokens(self, query: str, document: str) -> list[int]:
        """A (query, document) pair as a reranker reads it, as llama-server lays it out: the
        model's ``rerank`` chat template with ``{query}`` and ``{document}`` filled in, else
        BOS, the query, EOS, SEP, the document, EOS (each special token where the vocabulary
        adds it; SEP for a missing EOS)."""
        raw = C.llama_model_chat_template(self._model, b"rerank")
        if raw:
            text = raw.decode("utf-8", "replace")
            text = text.replace("{query}", query).replace("{document}", document)
            return self.tokenize(text, add_special=False, parse_special=True)
        v = self._vocab
        eos = C.llama_vocab_eos(v)
        if eos < 0:
            eos = C.llama_vocab_sep(v)
        out = [C.llama_vocab_bos(v)] if C.llama_vocab_get_add_bos(v) else []
        out += self.tokenize(query, add_special=False, parse_special=False)
        out += [eos] if C.llama_vocab_get_add_eos(v) else []
        out += [C.llama_vocab_sep(v)] if C.llama_vocab_get_add_sep(v) else []
        out += self.tokenize(document, add_special=False, parse_special=False)
        out += [eos] if C.llama_vocab_get_add_eos(v) else []
        return out

    def embedding_limit(self) -> int:
        """The most tokens one embedding input holds: 2,048, or the model's training context
        if smaller (a model with learned positions, such as GPT-2 or BERT, has none past
        it)."""
        return min(_EMBEDDING_CTX, self.n_ctx_train or _EMBEDDING_CTX)

    @_needs_model
    def embedding_context(self, pooling: str = "mean", n_ctx: int = 0) -> "EmbeddingContext":
        """A second context on the same weights, for sentence embeddings pooled as
        ``pooling`` says (mean, cls, last), of ``n_ctx`` tokens (at most, and by default,
        :meth:`embedding_limit`); closed with the backend."""
        limit = self.embedding_limit()
        ctx = EmbeddingContext(self, min(n_ctx, limit) if n_ctx > 0 else limit, pooling)
        self._children.append(ctx)
        return ctx

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        for ctx in self._children:
            ctx.close()
        self._children.clear()
        if self._ctx:
            C.llama_free(self._ctx)
            self._ctx = None
        for _, chain in self._graph_chains.values():  # the context only borrowed them
            C.llama_sampler_free(chain)
        self._graph_chains.clear()
        self._candidate_kinds.clear()  # (after the chains that used them)
        for adapter in self._loras:  # after the context that points to them
            C.llama_adapter_lora_free(adapter.handle)
        self._loras.clear()
        self._lora_set = ()
        if self._model:
            C.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "LlamaBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A loaded llama.cpp LoRA adapter; owned (and freed) by the backend that loaded it."""

    handle: object
    path: str


# ---- quantization ---------------------------------------------------------------------------

_PROGRESS = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")
_SIZES = re.compile(r"(model|quant) size\s*=\s*([\d.]+) MiB")


@dataclass(frozen=True)
class QuantizeResult:
    """What llama.cpp reported: the tensors' bytes before and after, and (a dry run) whether
    the real run would need an importance matrix."""

    model_bytes: int
    quant_bytes: int
    needs_imatrix: bool


def quantize_model(src: str, dst: str, ftype: int, *, threads: int = 0,
                   allow_requantize: bool = False, dry_run: bool = False,
                   imatrix: dict[str, np.ndarray] | None = None,
                   metadata: dict[str, str | int] | None = None,
                   progress: Callable[[int, int, str], None] | None = None) -> QuantizeResult:
    """``llama_model_quantize`` from ``src`` to ``dst`` as llama.cpp file type ``ftype``.

    ``dry_run`` computes only the sizes (and whether an importance matrix is needed), in
    well under a second. ``imatrix``: tensor name -> importance values (``models/quantize.py``
    reads the file); ``metadata``: keys written into the output (string or integer values);
    ``progress(i, n, tensor)`` is called as each tensor starts. llama.cpp reports a refusal
    (a requantization not allowed, a type that needs an imatrix) only in its log: a
    ModelLoadError with its reason. Runs on the calling thread; no model or context is
    involved, so it may run beside nothing else of llama.cpp in a CLI process."""
    lines: list[tuple[int, str]] = []

    def sink(level: int, text: str) -> None:
        lines.append((level, text))
        m = _PROGRESS.match(text) if progress is not None else None
        if m:
            progress(int(m.group(1)), int(m.group(2)), m.group(3))  # type: ignore[misc]

    C.llama_backend_init()
    params = C.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = ftype
    params.allow_requantize = allow_requantize
    params.dry_run = dry_run
    keep: list[object] = []  # C arrays llama.cpp reads during the call
    if imatrix:
        entries = (C.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(imatrix.items()):
            arr = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(arr)
            entries[i].name = name.encode()
            entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = arr.size
        keep.append(entries)
        params.imatrix = entries
    if metadata:
        overrides = (C.llama_model_kv_override * (len(metadata) + 1))()
        for i, (key, value) in enumerate(metadata.items()):
            o: Any = overrides[i]  # a union's fields: llama_cpp annotates the union as a value
            o.key = key.encode()[:127]
            if isinstance(value, int):
                o.tag = C.LLAMA_KV_OVERRIDE_TYPE_INT
                o.value.val_i64 = value
            else:
                o.tag = C.LLAMA_KV_OVERRIDE_TYPE_STR
                o.value.val_str = value.encode()[:127]
        keep.append(overrides)
        params.kv_overrides = overrides
    with _ctrl_c_held(), _log_to(sink):
        rc = C.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise ModelLoadError(f"llama.cpp could not quantize {src}: {_errors_of(lines)}")
    text = "".join(t for _, t in lines)
    sizes = {k: int(float(v) * 1024 * 1024) for k, v in _SIZES.findall(text)}
    return QuantizeResult(sizes.get("model", 0), sizes.get("quant", 0),
                          "will require an imatrix" in text)


_EMBEDDING_CTX = 2048
_EMBED_CHUNK = 512  # a causal model's embedding input per decode (EmbeddingContext says why)
# Architectures llama.cpp runs only as encoders (sentence embeddings), causal flag or not.
_ENCODER_ARCHS = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2",
                            "jina-bert-v3", "neo-bert", "modern-bert", "t5encoder"})
_POOLING = {"rank": C.LLAMA_POOLING_TYPE_RANK,
            "mean": C.LLAMA_POOLING_TYPE_MEAN, "cls": C.LLAMA_POOLING_TYPE_CLS,
            "last": C.LLAMA_POOLING_TYPE_LAST}


class _GgmlTensor(ctypes.Structure):
    """ggml.h's ``struct ggml_tensor``, as the pinned llama-cpp-python's ggml lays it out.
    Read only by :class:`_HiddenStates`, which checks the name, type, shape and strides it
    reads before it reads the data."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int),
                ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p),
                ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p),
                ("padding", ctypes.c_char * 8)]


class _HiddenStates:
    """A causal model's final hidden states (the tensor llama.cpp names ``result_norm`` and
    pools embeddings from), taken through a context's eval callback
    (``llama_context_params.cb_eval``), which then stops the graph: the language-model head
    after it, a vocabulary-wide matmul for every token (on the demo model half of a chunk's
    time), is never computed. ggml's scheduler asks the callback about each node in turn and
    computes up to the one it wants; answering False after reading it ends that part of the
    graph, and the decode returns 0. Only on a CPU build: a GPU's tensor data is device
    memory. A tensor whose type (f32), shape or strides are not a row per token is not read;
    ``EmbeddingContext`` uses this only where a probe gives the bits an embeddings context
    gives."""

    NAME = b"result_norm"

    def __init__(self, n_embd: int) -> None:
        self.n_embd = n_embd
        self.rows: np.ndarray | None = None
        self.callback = C.ggml_backend_sched_eval_callback(self._on_node)  # (kept alive here)

    def _on_node(self, node: int, ask: bool, _user: int | None) -> bool:
        t = ctypes.cast(node, ctypes.POINTER(_GgmlTensor)).contents
        if t.name != self.NAME:
            return not ask  # (not asked for; a node not asked for is never shown)
        if ask:
            return True
        rows, width = t.ne[1], t.ne[0]
        if (t.type != 0 or width != self.n_embd or t.ne[2] != 1 or t.ne[3] != 1
                or t.nb[0] != 4 or t.nb[1] != 4 * width or not t.data):
            return True  # not a row of f32 per token: let the graph go on, nothing taken
        data = ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float))
        self.rows = np.ctypeslib.as_array(data, shape=(rows, width)).copy()
        return False


class EmbeddingContext:
    """A second context on the model that pools one sequence's hidden states into an
    embedding (mean, its first token's state or its last's).

    A causal model's input goes through in chunks of ``_EMBED_CHUNK`` tokens (its KV carries
    the earlier ones) and its hidden states are pooled here, as llama.cpp pools them: an
    embeddings context makes every token an output and computes the language-model head for
    each, keeping the logits in host memory. In one batch, 2,048 tokens of the demo model's
    262k vocabulary took 2 GiB for those logits and as much again for the compute buffer (the
    server grew by 4.1 GiB at its first long embedding); in chunks of 512 it grows by 1 GiB.
    512 is llama-server's batch (``-ub``), which holds its whole embedding input: up to that
    an input's vector is llama-server's to the last bit. A longer one's differs as any batch
    of another shape does (docs/llama-cpp-facts.md): measured on a 300-token input cut in
    chunks, mean pooling within 1e-3 of the largest component (cosine 0.999998), the last
    token's state within 4% (cosine 0.997).

    On a CPU build the head is not computed at all: the hidden states are taken from the
    graph as soon as they exist and the graph stops there (:class:`_HiddenStates`), which
    halved the demo model's time (2,048 tokens: 4.1-4.8 s against 9.8-10.5 s) and its memory
    (+0.5 GiB against +1 GiB),
    with the same vectors to the bit. It is used only where a four-token probe gives the same
    bits both ways; elsewhere (a GPU build, a graph that names its tensors otherwise) the
    context is an embeddings context that pools nothing.

    An encoder's attention needs the whole input at once (it has no such head), and a
    reranker's score comes from llama.cpp's classification head: both go in one batch,
    pooled by llama.cpp.

    Shares the model with its backend (no second copy of the weights). Like every llama.cpp
    compute call, ``embed`` must run on the engine thread.
    """

    def __init__(self, backend: LlamaBackend, n_ctx: int, pooling: str = "mean") -> None:
        self._backend = backend
        self.n_ctx = n_ctx
        self._pooling = pooling
        self._stepwise = backend.generates() and pooling in ("mean", "cls", "last")
        self._chunk = min(n_ctx, _EMBED_CHUNK) if self._stepwise else n_ctx
        # what llama.cpp pools a sequence into: its hidden state, or a reranker's scores
        self.n_embd = (int(C.llama_model_n_cls_out(backend._model)) or 1 if pooling == "rank"
                       else int(C.llama_model_n_embd(backend._model)))
        self._batch = C.llama_batch_init(self._chunk, 0, 1)
        self._capture: _HiddenStates | None = None
        self._ctx: Any = None
        try:
            self._ctx = self._open(None)
            if self._stepwise and not gpu_offload_supported():
                self._take_states_from_the_graph()
        except BaseException:
            self.close()
            raise

    def _open(self, capture: _HiddenStates | None) -> Any:
        """A llama.cpp context for this one; with ``capture``, one that is not an embeddings
        context and shows the hidden states to it."""
        cparams = C.llama_context_default_params()
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = self._chunk
        cparams.n_ubatch = self._chunk
        cparams.n_seq_max = 1
        threads = self._backend.n_threads  # what the backend's context was given
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.embeddings = capture is None
        cparams.pooling_type = (C.LLAMA_POOLING_TYPE_NONE if self._stepwise
                                else _POOLING[self._pooling])
        if capture is not None:
            cparams.cb_eval = capture.callback
        cparams.no_perf = True
        ctx = C.llama_init_from_model(self._backend._model, cparams)
        if not ctx:
            raise ModelLoadError("llama.cpp could not create an embeddings context")
        return ctx

    def _take_states_from_the_graph(self) -> None:
        """Switch to a context whose hidden states are taken before the language-model head
        (:class:`_HiddenStates`) if it gives the same bits as this embeddings context for a
        few tokens, whatever the architecture names its tensors; else keep this one."""
        probe = [0, 1, 2, 3][:self._chunk]
        want = np.array(self._rows(probe, 0))
        capture = _HiddenStates(self.n_embd)
        try:
            other = self._open(capture)
        except ModelLoadError:  # (no memory for a second one: keep the first)
            return
        plain, self._ctx, self._capture = self._ctx, other, capture
        try:
            same = np.array_equal(self._rows(probe, 0), want)
        except EngineError:
            same = False
        if same:
            C.llama_free(plain)
        else:
            C.llama_free(self._ctx)
            self._ctx, self._capture = plain, None
        self._clear()

    def embed(self, tokens: list[int]) -> np.ndarray:
        """The pooled embedding of one token sequence, as llama.cpp pools it (not
        normalised: each API normalises it its own way)."""
        pieces = self.embed_in_pieces(tokens)
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return done.value

    def embed_in_pieces(self, tokens: list[int]) -> Generator[None, None, np.ndarray]:
        """:meth:`embed` as a generator that yields after each chunk but the last and returns
        the embedding, so that other work (the engine's steps) can go between chunks. The
        context holds one input at a time: another input must wait for this one's end."""
        n = len(tokens)
        if not 0 < n <= self.n_ctx:
            raise EngineError(f"embedding input of {n} tokens; must be 1..{self.n_ctx}")
        if min(tokens) < 0 or max(tokens) >= self._backend.n_vocab:
            raise EngineError("token id out of the vocabulary")
        self._clear()
        if not self._stepwise:
            self._decode(tokens, 0)
            ptr = C.llama_get_embeddings_seq(self._ctx, 0)
            if not ptr:
                raise EngineError("llama.cpp returned no pooled embedding")
            return np.array(np.ctypeslib.as_array(ptr, shape=(self.n_embd,)), dtype=np.float32)
        total = np.zeros(self.n_embd, dtype=np.float64)
        first = last = None
        for start in range(0, n, self._chunk):
            if start:
                yield
            rows = self._rows(tokens[start:start + self._chunk], start)
            if first is None:
                first = np.array(rows[0], dtype=np.float32)
            last = np.array(rows[-1], dtype=np.float32)  # (the next decode reuses the rows)
            total += rows.sum(axis=0, dtype=np.float64)
        if self._pooling == "cls":
            assert first is not None
            return first
        if self._pooling == "last":
            assert last is not None
            return last
        return (total / n).astype(np.float32)

    def _rows(self, tokens: list[int], start: int) -> np.ndarray:
        """The hidden states of ``tokens`` at positions ``start``..., a row each."""
        capture = self._capture
        if capture is not None:
            capture.rows = None
        self._decode(tokens, start)
        if capture is not None:
            if capture.rows is None or capture.rows.shape[0] != len(tokens):
                raise EngineError("llama.cpp's hidden states were not found in its graph")
            return capture.rows
        ptr = C.llama_get_embeddings(self._ctx)
        if not ptr:
            raise EngineError("llama.cpp returned no token embeddings")
        return np.ctypeslib.as_array(ptr, shape=(len(tokens), self.n_embd))

    def _clear(self) -> None:
        """Forget the last input (the context's KV)."""
        C.llama_memory_clear(C.llama_get_memory(self._ctx), True)

    def _decode(self, tokens: list[int], start: int) -> None:
        """``tokens`` at positions ``start``..., every one an output."""
        b = self._batch
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1
        b.n_tokens = len(tokens)
        rc = C.llama_decode(self._ctx, b)
        if rc != 0:
            raise EngineError(f"llama_decode (embeddings) failed with code {rc}")

    def close(self) -> None:
        if self._batch is not None:
            C.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            C.llama_free(self._ctx)
            self._ctx = None


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


# The process has one fd 2: one call at a time may take it over (:func:`_stderr_kept`).
_STDERR_TAKEN = threading.Lock()


@contextlib.contextmanager
def _stderr_kept(kept: list[str]) -> Iterator[None]:
    """fd 2 into a file for a call that writes its reason straight there, not to the log
    (llama.cpp's grammar parser: its error, then the whole grammar, a client's megabytes in
    the server's log); what was written is appended to ``kept``. Another thread's writes in
    that moment land there too: the caller writes back what is not the call's own."""
    with _STDERR_TAKEN, contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(tempfile.TemporaryFile())
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):  # (no temporary file, no fd 2 or
            # sys.stderr: the call as it was)
            yield
            return
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            kept.append(f.read().decode("utf-8", "replace"))


def _grammar_sampler(backend: LlamaBackend, gbnf: str) -> tuple[Any, str | None]:
    """llama.cpp's grammar sampler for ``gbnf`` (a null pointer where it refuses it) and why
    it refused it (as :meth:`LlamaBackend.grammar_error`). What its parser prints to stderr
    on a failure (the reason, then the whole grammar) is read for the reason, not printed."""
    lines: list[tuple[int, str]] = []
    printed: list[str] = []
    with _log_to(_kept(lines, False), backend.config.verbose), _stderr_kept(printed):
        smpl = C.llama_sampler_init_grammar(backend._vocab, gbnf.encode(), b"root")
    text = printed[0] if printed else ""
    # llama-grammar.cpp: fprintf(stderr, "%s: error parsing grammar: %s\n\n%s\n", ...)
    parsed = re.search(r"\w+: error parsing grammar: (.*)\n\n", text)
    reason = parsed.group(1).strip() if parsed else None
    if parsed is not None:
        dump = text.find(gbnf + "\n", parsed.end())
        text = text[:parsed.start()] + (text[dump + len(gbnf) + 1:] if dump >= 0 else "")
    if text:  # (not the parser's: another thread's, or llama.cpp's in verbose mode)
        with contextlib.suppress(OSError):
            data = text.encode()
            while data:
                data = data[os.write(2, data):]
    if smpl:
        return smpl, None
    reasons = [t.strip() for level, t in lines if level == 4 and t.strip()
               and t.strip() != "failed to parse grammar"]
    return smpl, reason or (reasons[0] if reasons else "")


class GrammarMatcher:
    """llama.cpp's grammar sampler used as a mask over one request's logits.

    ``allowed_argmax`` answers greedy requests by checking the best candidates first (the best
    allowed token among the top ones is the best allowed overall) and the whole vocabulary only
    when none of them fits; ``mask`` gives the full masked row for sampled requests.
    """

    PROBE = 64
    active = True  # (Constraint: it holds the answer from the first token)

    def __init__(self, backend: LlamaBackend, gbnf: str) -> None:
        self._smpl, why = _grammar_sampler(backend, gbnf)
        if not self._smpl:
            raise InvalidRequestError("the grammar could not be parsed"
                                      + (f": {why}" if why else ""), param="response_format")
        n = backend.n_vocab
        self._data = np.zeros(n, dtype=_TOKEN_DATA)
        arr: Any = C.llama_token_data_array()  # llama_cpp annotates its pointer as an array
        arr.data = ctypes.cast(self._data.ctypes.data, C.llama_token_data_p)
        arr.sorted = False
        self._arr = arr

    def _apply(self, ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
        k = ids.size
        view = self._data[:k]
        view["id"] = ids
        view["logit"] = logits
        self._arr.size = k
        self._arr.selected = -1
        C.llama_sampler_apply(self._smpl, ctypes.byref(self._arr))
        return view["logit"].copy()

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The row with every token the grammar forbids set to -inf."""
        masked = self._apply(np.arange(logits.size, dtype=np.int32), logits)
        if not np.isfinite(masked).any():
            raise GrammarDeadEndError("the grammar allows no further token: no token of "
                                      "this model continues it here")
        return masked

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts ``token`` next (one candidate, no full-row pass)."""
        one = self._apply(np.array([token], dtype=np.int32), np.zeros(1, dtype=np.float32))
        return bool(np.isfinite(one[0]))

    def allowed_argmax(self, logits: np.ndarray) -> int:
        top = np.argpartition(-logits, self.PROBE)[:self.PROBE].astype(np.int32)
        top = top[np.argsort(-logits[top], kind="stable")]
        masked = self._apply(top, logits[top])
        ok = np.isfinite(masked)
        if ok.any():
            return int(top[int(np.argmax(ok))])
        return int(np.argmax(self.mask(logits)))

    def accept(self, token: int) -> None:
        C.llama_sampler_accept(self._smpl, token)

    def close(self) -> None:
        if self._smpl:
            C.llama_sampler_free(self._smpl)
            self._smpl = None

    def __del__(self) -> None:
        self.close()
