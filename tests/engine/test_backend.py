"""The backend refuses what would abort the process, with an exception instead."""

import ctypes
import signal
import subprocess
import sys

import numpy as np
import pytest

from justllm.errors import EngineError
from tests.helpers import EXACT, ON_GPU, divergence_is_noise, llama_cpps_pooling


def test_guards(engine):
    b = engine.backend
    # The engine is shared: tests before may have left cached prefixes in its sequences.
    engine.flush_prefix_cache()
    engine.runner.apply_kv_ops(engine.scheduler.take_kv_ops())
    assert b.seq_pos_max(0) == -1
    with pytest.raises(EngineError):
        b.decode(b.config.n_batch + 1)  # more tokens than n_batch
    with pytest.raises(EngineError):
        b.decode(0)  # empty batch
    b.batch_tokens[:2] = [2, 100]
    b.batch_pos[:2] = [0, 1]
    b.batch_n_seq[:2] = 1  # one sequence each (the shared engine's last batch may have had more)
    b.batch_seq[:2] = [b.config.n_seq_max, 0]  # sequence id out of range
    b.batch_logits[:2] = [0, 1]
    with pytest.raises(EngineError):
        b.decode(2)
    b.batch_seq[:2] = [0, 0]
    b.batch_tokens[1] = b.n_vocab  # token id past the vocabulary
    with pytest.raises(EngineError):
        b.decode(2)
    with pytest.raises(EngineError):
        b.seq_rm(300)  # would abort inside llama.cpp's memory functions
    with pytest.raises(EngineError):
        b.seq_cp(0, b.config.n_seq_max)
    # still healthy afterwards
    b.batch_tokens[:2] = [2, 100]
    logits = b.decode(2)
    assert logits.shape == (1, b.n_vocab)
    b.seq_rm(0)
    assert b.seq_pos_max(0) == -1


def test_a_split_batch_decodes_its_parts_apart_and_goes_in_whole_or_not_at_all(model_path):
    """decode(n, split): the decodes at the head of the batch in a llama_decode of their own
    (core/scheduler.py split_decodes_at), the rows in batch order as if decoded in one call;
    when the second part finds no room, the first part's tokens (twins too) are taken out
    again, so the engine's view of the KV holds."""
    from justllm.engine.backend import BackendConfig, KVCacheFullError, LlamaBackend

    b = LlamaBackend(BackendConfig(model_path=model_path, n_ctx=256, n_batch=128, n_seq_max=4,
                                   keep_swa_cells=True, gpu=ON_GPU))
    try:
        text = b.tokenize("The history of the lighthouse on the northern cliffs began " * 24)
        prompt, head = text[:70], text[:10]

        def put(seq: int, tokens: list[int], start: int = 0, o: int = 0, last: bool = True):
            n = len(tokens)
            b.batch_tokens[o:o + n] = tokens
            b.batch_pos[o:o + n] = range(start, start + n)
            b.batch_n_seq[o:o + n] = 1
            b.batch_seq[o:o + n] = seq
            b.batch_logits[o:o + n] = 0
            b.batch_logits[o + n - 1] = last
            return o + n

        def decodes() -> int:  # one token each for sequences 1 and 2, at position 10
            return put(2, [text[11]], 10, o=put(1, [text[10]], 10))

        def step() -> int:  # the decodes, then the prompt of sequence 0
            return put(0, prompt, o=decodes())

        for seq in (1, 2):  # two sequences decoding
            b.decode(put(seq, head))
        first = np.array(b.decode(decodes()))  # each part on its own, as plain decodes
        reference = np.concatenate([first, b.decode(put(0, prompt))])
        for seq, p in ((0, 0), (1, 10), (2, 10)):
            b.seq_rm(seq, p)
        n = step()
        got = b.decode(n, split=2)
        assert got.shape == (3, b.n_vocab)
        np.testing.assert_allclose(got, reference, atol=1e-3)
        assert [b.seq_pos_max(s) for s in (0, 1, 2)] == [69, 10, 10]

        # No room for the prompt: the decodes' tokens come out again, twins included.
        b.seq_rm(0)
        for seq in (1, 2):
            b.seq_rm(seq, 10)
        b.decode(put(3, text[:96]))
        b.decode(put(3, text[:96], 96))  # 20 + 192 cells of 256 used
        n = step()
        with pytest.raises(KVCacheFullError):
            b.decode(n, split=2)
        assert [b.seq_pos_max(s) for s in (0, 1, 2)] == [-1, 9, 9]
        assert not b.twin_differs(1) and not b.twin_differs(2)
        b.seq_rm(3)
        n = step()
        assert np.argmax(b.decode(n, split=2)[0]) == np.argmax(reference[0])
    finally:
        b.close()


def test_threads_default_to_the_cpus_the_process_may_use(model_path):
    """0 threads (the default) is the affinity mask's count (taskset, a container's cpuset),
    not the machine's: a process pinned to one CPU decodes on one thread."""
    code = ("import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from justllm.engine.llm import LLM; "
            "llm = LLM(sys.argv[1], pool_blocks=8, max_seqs=1); "
            "print(llm.engine.backend.n_threads, os.cpu_count()); llm.close()")
    run = subprocess.run([sys.executable, "-c", code, model_path], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    threads, machine = map(int, run.stdout.split())
    assert threads == 1, (threads, machine)


def test_the_context_takes_the_micro_batch_and_flash_attention_it_is_given(model_path):
    """n_ubatch and flash attention (the knobs --gpu's defaults are tuned by) reach
    llama.cpp's context; a prompt longer than the micro-batch still prefills and generates,
    to the same first greedy token (later ones may differ: other kernels, other rounding; on
    a GPU even the first, within a near tie)."""
    from justllm.config import EngineConfig
    from justllm.core.sampling_params import SamplingParams
    from justllm.engine.backend import gpu_devices, gpu_offload_supported
    from justllm.engine.llm import LLM

    prompt = "The history of the lighthouse on the northern cliffs began " * 6
    params = SamplingParams(max_tokens=6, logprobs=5)
    firsts = []
    for ubatch, fa in ((0, "auto"), (32, "on"), (32, "off")):
        llm = LLM(model_path, pool_blocks=64, n_ubatch=ubatch, flash_attn=fa, max_seqs=2)
        try:
            assert llm.engine.backend.n_ubatch == (ubatch or llm.engine.config.n_ubatch)
            out = llm.generate([prompt], params)[0]
            assert len(out.token_ids) == 6
            firsts.append((out.token_ids[:1], out.logprobs[:1]))
        finally:
            llm.close()
    if EXACT or not ON_GPU:
        assert len({tuple(t) for t, _ in firsts}) == 1
    for tokens, logprobs in firsts[1:]:
        ok, why = divergence_is_noise(*firsts[0], tokens, logprobs)
        assert ok, why
    assert (gpu_devices() == []) is (not gpu_offload_supported())  # a CPU build sees no GPU
    with pytest.raises(ValueError, match="flash_attn must be auto, on or off"):
        EngineConfig(flash_attn="yes")
    with pytest.raises(ValueError, match="n_ubatch must be an integer >= 0"):
        EngineConfig(n_ubatch=-1)


def test_repack_decides_whether_llama_cpp_repacks_the_cpu_weights(model_path):
    """--repack reaches llama.cpp's model load: off keeps every weight in the file's layout,
    on lets llama.cpp repack them (AMX tiles or interleaved blocks: the demo model's Q4_K,
    Q6_K and Q8_0 weights have both on x86), and auto is on unless llama.cpp's CPU backend
    was built with AMX, whose path crashed the first decode on this project's Xeon. Each load
    runs in a process of its own and decodes nothing (a repacked AMX load would crash there);
    the load log says where the weights went."""
    import platform

    from justllm.engine.backend import gpu_offload_supported, repack_weights

    code = ("import sys; from justllm.engine.backend import BackendConfig, LlamaBackend; "
            "LlamaBackend(BackendConfig(sys.argv[1], n_ctx=256, n_seq_max=1, "
            "repack=sys.argv[2], verbose=True)).close()")

    def repacked(setting: str) -> bool:
        run = subprocess.run([sys.executable, "-c", code, model_path, setting],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert "CPU_Mapped model buffer size" in run.stderr, run.stderr[-2000:]
        return any(f"{kind} model buffer size" in run.stderr for kind in ("AMX", "CPU_REPACK"))

    assert not repacked("off")
    assert repacked("auto") is repack_weights("auto")
    # (a CUDA build keeps CPU layers in pinned host memory, which comes before the repacked
    # types in llama.cpp's list: nothing is repacked there)
    if platform.machine() in ("x86_64", "AMD64") and not gpu_offload_supported():
        assert repacked("on")
    assert repack_weights("on") and not repack_weights("off")


def test_candidates_taken_in_the_graph_hold_every_token_above_their_bound(model_path):
    """The candidate sampler of our own (engine/backend.py _CandidatesSampler), inside
    llama.cpp's decode graph, from the whole row or in two stages (slices, one padded): no
    logits row comes back; each row's candidates carry their probabilities under the whole
    row's softmax at the temperature (as the same batch decoded without it gives them, not
    renormalised to the candidates), and every token that weighs more than the bound given
    with them is among them (what makes a nucleus draw from them exact); from the whole row
    they are the k best. Without it the rows come back again."""
    import numpy as np

    from justllm.engine.backend import BackendConfig, GraphSampling, LlamaBackend

    b = LlamaBackend(BackendConfig(model_path, n_ctx=512, n_seq_max=2, gpu=ON_GPU))
    try:  # (on the GPU under JUSTLLM_GPU=1: where the graph's output is on the device)
        prompts = [b.tokenize("The capital of France is"), b.tokenize("Once upon a time, the")]

        def decode() -> np.ndarray:
            b.clear_kv()
            n = 0
            for seq, ids in enumerate(prompts):
                for pos, token in enumerate(ids):
                    b.batch_tokens[n], b.batch_pos[n], b.batch_seq[n] = token, pos, seq
                    b.batch_n_seq[n], b.batch_logits[n] = 1, int(pos == len(ids) - 1)
                    n += 1
            return np.array(b.decode(n), dtype=np.float64)  # (a copy: the next decode reuses it)

        rows = decode()
        temperature = 0.7
        for k, segment in ((256, 0), (256, 1000)):
            b.set_tokens_in_graph([0, 1], temperature, candidates=k, segment=segment)
            assert decode().shape == (0, b.n_vocab)  # nothing copied out
            for seq, out in enumerate((len(prompts[0]) - 1,
                                       len(prompts[0]) + len(prompts[1]) - 1)):
                ids, probs, bound = b.graph_candidates(out)
                x = rows[seq]
                w = np.exp((x - x.max()) / temperature)
                w /= w.sum()
                assert ids.size == k == np.unique(ids).size and ids.max() < b.n_vocab
                assert probs == pytest.approx(w[ids], abs=1e-3 if EXACT else 0.02)
                assert 0.9 < probs.sum() < 1.0  # the row's mass, not renormalised to the k
                # (where kernels depend on the batch, a near tie at the bound may fall either way)
                above = set(np.flatnonzero(w > bound * (1.0001 if EXACT else 1.5)).tolist())
                assert 100 < len(above) and above <= set(ids.tolist()), (k, segment)
                if not segment:
                    assert bound == probs.min()
        b.set_tokens_in_graph([])
        assert decode() == pytest.approx(rows, abs=0.05)  # (a GPU need not repeat bit for bit)
        with pytest.raises(EngineError):
            b.set_graph_sampling({0: GraphSampling(0.0, candidates=8)})
        with pytest.raises(EngineError):
            b.set_graph_sampling({0: GraphSampling(1.0, candidates=64, segment=32)})
        # (ggml's top-k aborts when asked for more than it is given: a small vocabulary's
        # slices give fewer than k, and set_graph_sampling refuses such a k)
        from justllm.engine.backend import most_candidates
        assert most_candidates(8000, 1024) == 8 * 64
        assert most_candidates(8000, 0) == 8000 and most_candidates(800, 1024) == 800
        assert most_candidates(b.n_vocab, 1024) == 256 * 64
    finally:
        b.close()


def test_tokens_chosen_in_the_graph_are_numpys_argmax_or_a_nucleus_draw(model_path):
    """llama.cpp's backend sampling, as benchmarks/engine_throughput.py --raw uses it: the
    tokens chosen inside the graph are the argmax of the logits the same batches give, no
    logits come back when every row was chosen there, a batch with a row that was not gets
    its logits (and that row no graph token), and turning it off restores the logits; a draw
    in the graph keeps to the nucleus and to its seed."""
    import numpy as np

    from justllm.config import EngineConfig
    from justllm.engine.engine import Engine

    engine = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=64))
    b = engine.backend
    try:
        prompts = [b.tokenize("The lighthouse keeper"), b.tokenize("Once upon a time, the")]

        def run(in_graph: bool, steps: int = 5) -> list[list[int]]:
            b.clear_kv()
            b.set_tokens_in_graph([])  # the prompts' last rows: read as logits
            firsts = []
            for seq, ids in enumerate(prompts):
                n = len(ids)
                b.batch_tokens[:n], b.batch_pos[:n] = ids, range(n)
                b.batch_seq[:n], b.batch_n_seq[:n], b.batch_logits[:n] = seq, 1, 0
                b.batch_logits[n - 1] = 1
                firsts.append(int(b.decode(n)[0].argmax()))
            if in_graph:
                b.set_tokens_in_graph([0, 1])
            nxt, out = firsts, []
            for step in range(steps):
                b.batch_tokens[:2] = nxt
                b.batch_pos[:2] = [len(p) + step for p in prompts]
                b.batch_seq[:2], b.batch_n_seq[:2], b.batch_logits[:2] = [0, 1], 1, 1
                logits = b.decode(2)
                if in_graph:
                    assert logits.shape == (0, b.n_vocab)  # nothing copied out
                    nxt = b.graph_tokens(2)
                else:
                    nxt = [int(i) for i in np.asarray(logits).argmax(axis=1)]
                out.append(nxt)
            return out

        in_numpy = run(False)
        assert run(True) == in_numpy
        b.set_tokens_in_graph([0, 1])  # the same sequences again: kept as they are
        # One row chosen in the graph, one not: every row's logits come back, and only the
        # first row has a graph token.
        b.set_tokens_in_graph([0])
        b.batch_tokens[:2] = in_numpy[-1]
        b.batch_pos[:2] = [len(p) + 5 for p in prompts]
        b.batch_seq[:2], b.batch_n_seq[:2], b.batch_logits[:2] = [0, 1], 1, 1
        logits = np.asarray(b.decode(2))
        assert logits.shape == (2, b.n_vocab)
        assert b.graph_tokens(1) == [int(logits[0].argmax())]
        with pytest.raises(EngineError, match="not chosen in the graph"):
            b.graph_tokens(2)
        with pytest.raises(EngineError, match="out of range"):
            b.set_tokens_in_graph([b.config.n_seq_max])
        assert run(False) == in_numpy  # off again: the logits as before

        # A draw in the graph (temperature 0.8, top_p 0.5): with sequence 1 read as logits,
        # every step shows that sequence 0's token lies in the nucleus of its own logits, and
        # the same seed draws the same tokens again.
        def drawn(seed: int) -> list[int]:
            b.clear_kv()
            b.set_tokens_in_graph([])
            for seq, ids in enumerate(prompts[:1] * 2):
                n = len(ids)
                b.batch_tokens[:n], b.batch_pos[:n] = ids, range(n)
                b.batch_seq[:n], b.batch_n_seq[:n], b.batch_logits[:n] = seq, 1, 0
                b.batch_logits[n - 1] = 1
                first = int(b.decode(n)[0].argmax())
            b.set_tokens_in_graph([0], temperature=0.8, top_p=0.5, seed=seed)
            nxt, got = [first, first], []
            for step in range(6):
                b.batch_tokens[:2] = nxt
                b.batch_pos[:2] = len(prompts[0]) + step
                b.batch_seq[:2], b.batch_n_seq[:2], b.batch_logits[:2] = [0, 1], 1, 1
                x = np.asarray(b.decode(2))[0] / 0.8
                token = b.graph_tokens(1)[0]
                p = np.exp(x - x.max())
                p /= p.sum()
                order = np.argsort(-p)
                nucleus = order[:int(np.searchsorted(np.cumsum(p[order]), 0.5)) + 1]
                assert token in nucleus, (step, token, nucleus[:5])
                got.append(token)
                nxt = [token, token]  # both sequences go on with the drawn token
            return got

        assert drawn(7) == drawn(7)
        with pytest.raises(EngineError, match="top_p"):
            b.set_tokens_in_graph([0], temperature=0.8, top_p=0.0)
    finally:
        b.set_tokens_in_graph([])
        engine.close()


def test_ctrl_c_while_llama_cpp_loads_a_model_stops_the_load(model_path, monkeypatch):
    """Ctrl-C lands in one of our C callbacks while llama.cpp works, since that is the only
    Python code running then; a KeyboardInterrupt raised there was printed and dropped by
    ctypes, and the command went on (loaded the model, quantized it). The signal here comes
    from the log sink itself, as it would during a load."""
    from justllm.engine import backend

    def sink(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)

    sent: list[bool] = []
    signalling = backend.C.llama_log_callback(sink)
    monkeypatch.setattr(backend, "_usual_log", lambda verbose: signalling)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a command
    try:
        config = backend.BackendConfig(model_path, n_ctx=256, n_seq_max=1)
        with pytest.raises(KeyboardInterrupt):
            backend.LlamaBackend(config)
        assert sent and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        monkeypatch.undo()
        with backend.LlamaBackend(config) as b:  # and the next load is a load as usual
            assert b.n_vocab > 0
    finally:
        signal.signal(signal.SIGINT, previous)


def llama_cpps_infill(vocab, ids: list[int], logits) -> list[int]:
    """What llama.cpp's own infill sampler keeps of these candidates (ids; a removed end
    token stays in its array at -inf, so it is left out here as it can never be drawn)."""
    import math

    from llama_cpp import llama_cpp as C

    arr = (C.llama_token_data * len(ids))(*[C.llama_token_data(t, float(v), 0.0)
                                           for t, v in zip(ids, logits)])
    cur = C.llama_token_data_array(arr, len(ids), -1, False)
    smpl = C.llama_sampler_init_infill(vocab)
    try:
        C.llama_sampler_apply(smpl, ctypes.byref(cur))
    finally:
        C.llama_sampler_free(smpl)
    return sorted(arr[i].id for i in range(cur.size) if not math.isinf(arr[i].logit))


def test_the_infill_step_keeps_what_llama_cpps_infill_sampler_keeps(engine):
    """engine/sampler.py's infill step against llama.cpp's on the same candidates: sets like
    a top-40 with tokens whose text begins others' (so merges happen), sometimes an end token,
    at flat to peaked logits (every branch: the end alone, merges, the cut, nothing left)."""
    import numpy as np

    from justllm.engine.sampler import InfillVocab, infill_keep

    b = engine.backend
    pieces = [b.token_to_piece(t) for t in range(b.n_vocab)]
    short = [t for t, p in enumerate(pieces) if 1 <= len(p) <= 3 and p.isascii()]
    vocab = InfillVocab(b.token_to_piece, b.is_eog, b.end_of_turn())
    ends = [int(t) for t in b.eog_ids()]
    rng = np.random.default_rng(7)
    seen = {"end alone": 0, "ended": 0, "merged": 0, "kept": 0}
    for _ in range(300):
        ids: set[int] = set()
        for seed in rng.choice(short, 4):
            head = pieces[seed]
            longer = [t for t in range(0, b.n_vocab, 7) if pieces[t].startswith(head)][:6]
            ids |= {int(seed), *longer}
        ids |= {int(t) for t in rng.integers(0, b.n_vocab, 40 - min(len(ids), 39))}
        if rng.random() < 0.5:
            ids.add(int(rng.choice(ends)))
        cand = np.array(sorted(ids)[:40])
        z = rng.normal(0.0, rng.uniform(0.3, 6.0), cand.size).astype(np.float32)
        keep = infill_keep(z, cand, vocab)
        ours = [vocab.end] if keep is None else sorted(cand[keep].tolist())
        assert ours == llama_cpps_infill(b._vocab, cand.tolist(), z), (cand, z)
        if keep is None:
            seen["ended"] += 1
        elif all(b.is_eog(t) for t in ours):
            seen["end alone"] += 1
        else:
            seen["kept"] += 1
            texts = [pieces[t] for t in cand if pieces[t]]
            seen["merged"] += any(x != y and y.startswith(x) for x in texts for y in texts)
    assert all(n > 5 for n in seen.values()), seen


def test_a_causal_models_embeddings_go_in_chunks_pooled_as_llama_cpp_pools_them(
        engine, model_path, monkeypatch):
    """A causal model's embedding input is decoded a chunk at a time (one batch made llama.cpp
    keep a logits row of the whole vocabulary for every token: 4 GiB at 2,048 tokens) and
    pooled here: mean, first token or last token. Within one chunk (512 tokens, llama-server's
    batch) that is exactly llama.cpp's pooling of the input in one batch; across chunks it is
    the same within the noise of another batch shape (mean within 1e-3 of the largest
    component; the last token's state measured at cosine 0.997, the mean's at 0.72). On this
    CPU build the hidden states are taken from the graph before the language-model head where
    a probe shows that they are the ones an embeddings context gives."""
    import llama_cpp as C

    import justllm.engine.backend as backend_module
    from justllm.engine.backend import EmbeddingContext, gpu_offload_supported

    def embed(pooling: str, chunk: int, tensor: bytes = b"result_norm") -> np.ndarray:
        """``tensor``: what the graph's hidden states are taken from (the last layer's output
        where the architecture names it ``result_norm``)."""
        monkeypatch.setattr(backend_module, "_EMBED_CHUNK", chunk)
        with monkeypatch.context() as m:
            m.setattr(backend_module._HiddenStates, "NAME", tensor)
            ctx = EmbeddingContext(engine.backend, 256, pooling)
        try:
            # Taken from the graph only where a probe gives the embeddings context's bits
            # (never on a build that can offload: its graph may run on the GPU).
            assert (ctx._capture is not None) is (tensor == b"result_norm"
                                                  and not gpu_offload_supported())
            return ctx.embed(tokens)
        finally:
            ctx.close()

    def cosine(a: np.ndarray, b: np.ndarray) -> float:
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    tokens = engine.backend.tokenize(
        "The lighthouse keeper wrote down every ship that passed. " * 30)[:200]
    assert len(tokens) == 200
    want = {name: llama_cpps_pooling(model_path, [tokens], kind)[0]
            for name, kind in (("mean", C.LLAMA_POOLING_TYPE_MEAN),
                               ("cls", C.LLAMA_POOLING_TYPE_CLS),
                               ("last", C.LLAMA_POOLING_TYPE_LAST))}
    scale = np.abs(want["mean"]).max()
    np.testing.assert_allclose(embed("mean", 512), want["mean"], rtol=0, atol=1e-6 * scale)
    chunked = {p: embed(p, 64) for p in ("mean", "cls", "last")}  # four chunks
    assert all(v.shape == (640,) for v in chunked.values())  # (the demo model's width)
    np.testing.assert_allclose(chunked["mean"], want["mean"], rtol=0, atol=5e-3 * scale)
    if not gpu_offload_supported():  # (all in the first chunk: the same bits on a CPU)
        np.testing.assert_array_equal(chunked["cls"], want["cls"])
    else:
        assert cosine(chunked["cls"], want["cls"]) > 0.999
    assert cosine(chunked["last"], want["last"]) > 0.99
    # No such tensor, or another one (the first layer's normed input, as wide): the ordinary
    # embeddings context, which gives the same bits.
    for other in (b"no such tensor", b"attn_norm-0"):
        np.testing.assert_array_equal(embed("mean", 64, other), chunked["mean"])


def test_a_model_file_its_caller_checked_is_not_read_again(model_path, monkeypatch):
    """``justllm serve`` reads the GGUF header before it binds its port (a bad file is one
    line, not a server that fails in the background); the engine it starts read it again."""
    import justllm.engine.backend as b

    def read_again(*_args, **_kwargs):
        raise AssertionError("the header was read again")

    monkeypatch.setattr(b, "read_gguf_header", read_again)
    b.LlamaBackend(b.BackendConfig(model_path=model_path, n_ctx=256,
                                   model_checked=True)).close()
    with pytest.raises(AssertionError, match="read again"):  # any other caller's is read
        b.LlamaBackend(b.BackendConfig(model_path=model_path, n_ctx=256))


def test_a_load_whose_caller_cancels_it_stops_with_load_cancelled(model_path):
    """BackendConfig.cancel (a server shutting down while its model loads): llama.cpp stops
    at its next progress report and the backend says why, not "could not load"."""
    from justllm.engine import backend
    from justllm.errors import LoadCancelled

    asked: list[bool] = []

    def cancel() -> bool:
        asked.append(True)
        return True

    with pytest.raises(LoadCancelled):
        backend.LlamaBackend(backend.BackendConfig(model_path, n_ctx=256, n_seq_max=1,
                                                   cancel=cancel))
    assert asked
    config = backend.BackendConfig(model_path, n_ctx=256, n_seq_max=1, cancel=lambda: False)
    with backend.LlamaBackend(config) as b:  # a cancel that never answers True: a load
        assert b.n_vocab > 0


def test_a_grammar_llama_cpp_cannot_parse_gives_its_reason_and_prints_nothing(engine, capfd,
                                                                              monkeypatch):
    """llama.cpp's grammar parser writes its reason, then the whole grammar, straight to
    stderr (a client's grammar of megabytes in the server's log, and a 400 without the
    reason): the reason is read from there into the error, and nothing is printed; what
    another writer puts on stderr meanwhile still gets there."""
    import os

    import justllm.engine.backend as backend_module
    from justllm.errors import InvalidRequestError

    C = backend_module.C
    assert engine.backend.grammar_error('root ::= "a" | "b" ( "c"') == "expecting ')' at"
    with pytest.raises(InvalidRequestError, match="could not be parsed: Undefined rule "
                                                  "identifier 'nope'"):
        engine.backend.grammar("root ::= nope")
    assert engine.backend.grammar_error('root ::= "a"') is None
    err = capfd.readouterr().err
    assert "root ::=" not in err and "error parsing grammar" not in err, err

    parse = C.llama_sampler_init_grammar

    def with_another_writer(*args):
        os.write(2, b"another thread's line\n")
        return parse(*args)

    monkeypatch.setattr(C, "llama_sampler_init_grammar", with_another_writer)
    assert engine.backend.grammar_error("root ::= nope") == "Undefined rule identifier 'nope'"
    assert capfd.readouterr().err == "another thread's line\n"
    # No temporary file to be had: the grammar is still checked (the reason then printed).
    monkeypatch.undo()

    def no_file(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(backend_module.tempfile, "TemporaryFile", no_file)
    assert engine.backend.grammar_error("root ::= nope") == ""
    assert engine.backend.grammar_error('root ::= "a"') is None
    assert "Undefined rule identifier 'nope'" in capfd.readouterr().err
