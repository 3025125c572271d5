"""Helpers for comparing greedy outputs across batch shapes (docs/llama-cpp-facts.md: Numerics),
for llama.cpp's own pooled embeddings, and for the processes a test started."""

from __future__ import annotations

import signal
import subprocess
import tempfile
from typing import IO

import numpy as np

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.backend import gpu_offload_supported, repack_weights
from justllm.engine.engine import Engine

# Batch-shape noise moves logits by up to ~0.8 (docs/llama-cpp-facts.md). A divergence is accepted only where
# the reference itself saw a near tie: the other run's token within this many nats of the best.
NEAR_TIE_NATS = 1.0

# Tests run with the model on a GPU where JUSTLLM_GPU=1 (benchmarks/gpu_check.sh; tests/conftest.py
# keeps it in the environment). There, the same tokens computed twice need not come out
# bit-identical: llama.cpp's CUDA kernels (flash attention, the matmul chosen by batch shape, the
# KV cells' positions) round differently from one decode to the next.
ON_GPU = EngineConfig().gpu  # (JUSTLLM_GPU, read as every engine reads it)
# On the CPU, a row's logits may or may not depend on the batch around it, and that is
# measured here, not guessed from the CPU: the Xeons this suite first ran on, with llama.cpp's
# repacked weight layouts, gave a row the same logits in any batch and after any prefix-cache
# hit, but an AMD EPYC with AVX2 (no AVX-512) did not: a prompt's last logits moved by up to
# 1.3 between the prompt prefilled whole and in two pieces (flash attention's tiled path for
# 64 queries or more against its one-row path), and by 1.2 beside other sequences' tokens
# with flash attention off (the repacked matmul for several rows against one). Where the
# kernels depend on the batch (also every GPU, and a CUDA build's CPU layers, which stay
# unpacked), a prefix-cache hit or another batch moves the logits a little, as on a GPU (on a
# 2-core Xeon with AMX: 0.05 nats, a near tie flipped in one of 16 greedy requests run twice;
# on the 16-core Xeon of an H200 machine, CUDA build: a prompt scored twice differed by up to
# 0.24 nats a token, and 7 of 16 greedy requests run together equalled their solo runs).
def _rows_ignore_the_batch() -> bool:
    """Whether this build gives a row bit-identical logits whatever else its batch holds and
    however its prompt was cut: the demo model, with the engine's default settings, computes
    an 86-token prompt whole, in two pieces (40 + 46, as after a prefix-cache hit), and whole
    beside 8 tokens of another sequence, and its last token once more alone."""
    from justllm.engine.backend import BackendConfig, LlamaBackend
    from justllm.models.source import demo_model_path

    with LlamaBackend(BackendConfig(str(demo_model_path()), n_ctx=512, n_seq_max=2)) as b:
        tokens = b.tokenize("The quick brown fox jumps over the lazy dog while the cat "
                            "sleeps. " * 6)

        def last_logits(pieces: list[list[int]], beside: int = 0) -> np.ndarray:
            assert not beside or len(pieces) == 1  # (the other sequence's tokens go in once)
            b.clear_kv()
            pos = 0
            for piece in pieces:
                n, m = len(piece), len(piece) + beside
                b.batch_tokens[:m] = piece + tokens[:beside]
                b.batch_pos[:m] = [*range(pos, pos + n), *range(beside)]
                b.batch_seq[:m] = [0] * n + [1] * beside
                b.batch_n_seq[:m] = 1
                b.batch_logits[:m] = 0
                b.batch_logits[n - 1] = 1
                out = np.array(b.decode(m)[0])
                pos += n
            return out

        whole = last_logits([tokens])
        return all(np.array_equal(whole, other) for other in (
            last_logits([tokens[:40], tokens[40:]]), last_logits([tokens], beside=8),
            last_logits([tokens[:-1], tokens[-1:]])))


EXACT = not ON_GPU and not gpu_offload_supported() and _rows_ignore_the_batch()
RESCORE_NATS = 1e-3 if EXACT else 0.5  # one prompt's log-probabilities, scored twice

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "Explain photosynthesis in one sentence.",
    "1, 2, 3, 4,",
    "Translate 'good morning' into Spanish:",
    "The best way to learn programming is",
    "Q: What is 7 times 8?\nA:",
    "import numpy as np\n",
    "My favourite food is",
    "In the year 2050, cities will",
    "The moon is",
    "A list of prime numbers: 2, 3, 5,",
]


def run_all(engine: Engine, prompts, params: SamplingParams) -> dict[str, tuple[list[int], list]]:
    """Run prompts together on the engine; returns id -> (tokens, logprobs)."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    logprobs = {i: [] for i in ids}
    done = set()
    while len(done) < len(ids):
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.token_ids)
            logprobs[out.request_id].extend(out.logprobs or [])
            if out.finished:
                done.add(out.request_id)
    return {i: (tokens[i], logprobs[i]) for i in ids}


def run_alone(engine: Engine, prompt, params: SamplingParams):
    ((tokens, logprobs),) = run_all(engine, [prompt], params).values()
    return tokens, logprobs


def run_in_fresh_engine(config: EngineConfig, prompt, params: SamplingParams):
    """``run_alone`` in an engine of its own, closed after (a reference run)."""
    engine = Engine(config)
    try:
        return run_alone(engine, prompt, params)
    finally:
        engine.close()


def assert_same_run(reference, got) -> None:
    """``got`` ((tokens, logprobs) with top-5) is what ``reference`` computed from the same
    prompt: exactly (tokens, logprobs and top logprobs) where the kernels do not depend on
    the batch (EXACT), else up to a near tie."""
    if EXACT:
        assert got[0] == reference[0]
        assert [lp.logprob for lp in got[1]] == [lp.logprob for lp in reference[1]]
        assert [lp.top for lp in got[1]] == [lp.top for lp in reference[1]]
    else:
        ok, why = divergence_is_noise(reference[0], reference[1], got[0], got[1])
        assert ok, why


def divergence_is_noise(reference: list[int], ref_logprobs, other: list[int],
                        other_logprobs=None) -> tuple[bool, str]:
    """True when ``other`` equals ``reference`` up to its first difference, and that difference
    is a near tie in the reference's own distribution (``ref_logprobs`` has top-5 per step).
    With ``other_logprobs``, every shared step's log-probability must also agree within the
    noise bound: a request computed against another request's KV would not."""
    n = min(len(reference), len(other))
    for i in range(n):
        if other_logprobs and reference[i] == other[i]:
            drift = abs(ref_logprobs[i].logprob - other_logprobs[i].logprob)
            if drift > NEAR_TIE_NATS:
                return False, f"step {i}: log-probability moved by {drift:.2f} nats"
        if reference[i] != other[i]:
            top = dict(ref_logprobs[i].top)
            best = ref_logprobs[i].logprob
            if other[i] not in top:
                return False, f"step {i}: token {other[i]} not in the reference top-5 {top}"
            gap = best - top[other[i]]
            if gap > NEAR_TIE_NATS:
                return False, f"step {i}: token {other[i]} is {gap:.2f} nats below the best"
            return True, f"near tie at step {i} (gap {gap:.2f})"
    if len(reference) != len(other):
        return False, f"lengths differ with no divergence: {len(reference)} vs {len(other)}"
    return True, "identical"


def count_graph_tokens(engine: Engine) -> dict[str, int]:
    """Count what the engine reads from llama.cpp's graph (--backend-sampling): ``"graph"``
    goes up by one with each token chosen there, ``"candidates"`` with each row whose
    candidates it took, ``"again"`` with each of those rows computed again (their draw
    undecided)."""
    counted = {"graph": 0, "candidates": 0, "again": 0}

    def counting(key: str, read):
        def read_counted(arg):
            counted[key] += 1
            return read(arg)
        return read_counted

    b = engine.backend
    b.graph_token = counting("graph", b.graph_token)  # type: ignore[method-assign]
    b.graph_candidates = counting("candidates", b.graph_candidates)  # type: ignore[method-assign]
    engine._row_again = counting("again", engine._row_again)  # type: ignore[method-assign]
    return counted


def llama_cpps_pooling(path, token_lists: list[list[int]], pooling: int, n_ctx: int = 256
                       ) -> list[np.ndarray]:
    """Each token list pooled by llama.cpp itself, the whole list in one batch of a context
    that pools it (``pooling``: a ``LLAMA_POOLING_TYPE_*``), through the bindings' C API:
    what llama-server's --embeddings reads (a vector), or its --reranking (the first value:
    the score). The weights are laid out as ``--repack auto`` lays them (this CPU's AMX path
    crashes)."""
    import llama_cpp as C

    mparams = C.llama_model_default_params()
    mparams.use_extra_bufts = repack_weights("auto")
    model = C.llama_model_load_from_file(str(path).encode(), mparams)
    params = C.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
    params.embeddings = True
    params.pooling_type = pooling
    ctx = C.llama_init_from_model(model, params)
    width = ((C.llama_model_n_cls_out(model) or 1) if pooling == C.LLAMA_POOLING_TYPE_RANK
             else C.llama_model_n_embd(model))
    try:
        out = []
        for tokens in token_lists:
            C.llama_memory_clear(C.llama_get_memory(ctx), True)
            ids = (C.llama_token * len(tokens))(*tokens)  # (kept alive while decoded)
            assert C.llama_decode(ctx, C.llama_batch_get_one(ids, len(tokens))) == 0
            out.append(np.array(C.llama_get_embeddings_seq(ctx, 0)[:width], dtype=np.float32))
        return out
    finally:
        C.llama_free(ctx)
        C.llama_model_free(model)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started that have not been reaped."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def start_logged(cmd: list[str], env: dict) -> tuple[subprocess.Popen, IO[bytes]]:
    """``cmd`` started with its stdout and stderr in an anonymous temporary file (a pipe that
    nobody reads while the process runs blocks it once the pipe is full); read it with
    :func:`logged_text`."""
    log = tempfile.TemporaryFile()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log


def logged_text(log: IO[bytes]) -> str:
    """All that a :func:`start_logged` process has printed so far."""
    log.seek(0)
    return log.read().decode(errors="replace")


def default_sigint() -> None:
    """A child's ``preexec_fn``: Python's own Ctrl-C handler, as at a terminal (a background
    job, such as a CI run, ignores SIGINT, and its children inherit that: a test's SIGINT then
    did nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
