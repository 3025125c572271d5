"""Speculative decoding inside the engine, on the real demo model through real llama.cpp.

Each proposer (n-gram prompt lookup, a draft model, a draft-model tree) must be lossless: greedy
outputs equal plain decoding up to batch-shape noise (tests/helpers.py), while the counters show
drafts were verified and accepted and the KV holds nothing afterwards. A hand-made tree checks
that verification follows the branch the target agrees with, even when it is not the first.

The target drafting for itself (``draft_model=model_path``) agrees with itself almost always,
which exercises acceptance; the 6-layer ``justllm draft make`` copy is a bad draft, which
exercises rejection. Engines are shared per module; every test leaves them idle.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from justllm.config import EngineConfig
from justllm.core.plan import DraftTree
from justllm.core.sampling_params import SamplingParams
from justllm.engine.backend import LlamaBackend
from justllm.engine.engine import Engine
from justllm.errors import InvalidRequestError, ModelLoadError
from tests.helpers import NEAR_TIE_NATS, divergence_is_noise, run_alone

N = 20  # tokens per request
GREEDY = SamplingParams(max_tokens=N, logprobs=5, ignore_eos=True)
BASE = dict(max_seqs=8, pool_blocks=256)

# Code that repeats: prompt lookup finds its continuation, and a draft model agrees with it.
REPETITIVE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
              "def mul(a, b):\n    return a * b\n\ndef add(a, b):\n")
PROMPTS = [
    REPETITIVE,
    "The capital of France is",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
]
STORY = "Once upon a time, in a small village,"


# ---- engines (one of each per module) ----------------------------------------------------

def _engine(model_path, **kw):
    eng = Engine(EngineConfig(model=model_path, **{**BASE, **kw}))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def plain(model_path):
    """The reference: no speculation, no prefix cache (every prompt computed the same way)."""
    yield from _engine(model_path, prefix_cache=False)


@pytest.fixture(scope="module")
def ngram(model_path):
    yield from _engine(model_path, spec="ngram")  # prefix cache on


@pytest.fixture(scope="module")
def draft(model_path):
    yield from _engine(model_path, spec="draft", draft_model=model_path, prefix_cache=False)


@pytest.fixture(scope="module")
def tree(model_path):
    yield from _engine(model_path, spec="tree", draft_model=model_path, branch=2,
                       prefix_cache=False)


@pytest.fixture(scope="module")
def draft6_path(cli_draft6) -> Path:
    """A 6-of-18-layer draft of the demo model (`justllm draft make`, once per session)."""
    return cli_draft6[1]


@pytest.fixture(scope="module")
def made(model_path, draft6_path):
    yield from _engine(model_path, spec="draft", draft_model=str(draft6_path))  # prefix cache on


@pytest.fixture(scope="module")
def reference(plain):
    """prompt -> (tokens, logprobs) of a plain greedy run alone, computed once."""
    memo: dict[str, tuple[list[int], list]] = {}

    def get(prompt: str):
        if prompt not in memo:
            memo[prompt] = run_alone(plain, prompt, GREEDY)
        return memo[prompt]

    return get


# ---- helpers -----------------------------------------------------------------------------

def run_counting(engine: Engine, prompt: str, params: SamplingParams):
    """Run one request alone; (tokens, logprobs, steps that produced tokens for it)."""
    rid = engine.add_request(prompt, params)
    tokens, logprobs, steps = [], [], 0
    while True:
        outs = [o for o in engine.step() if o.request_id == rid]
        for o in outs:
            assert o.error is None, o.error
            tokens += o.token_ids
            logprobs += o.logprobs or []
        steps += bool(outs and outs[0].token_ids)
        if outs and outs[0].finished:
            return tokens, logprobs, steps


def run_mixed(engine: Engine, requests: list[tuple[str, SamplingParams]]):
    """Run requests with their own params together; [(tokens, logprobs)] in order."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    got = {i: ([], []) for i in ids}
    done: set[str] = set()
    while len(done) < len(ids):
        for o in engine.step():
            assert o.error is None, o.error
            got[o.request_id][0].extend(o.token_ids)
            got[o.request_id][1].extend(o.logprobs or [])
            if o.finished:
                done.add(o.request_id)
    return [got[i] for i in ids]


def delta(engine: Engine, before):
    s = engine.stats().spec
    return (s.num_drafts - before.num_drafts, s.num_draft_tokens - before.num_draft_tokens,
            s.num_accepted_tokens - before.num_accepted_tokens)


def assert_kv_clean(engine: Engine) -> None:
    """Every request finished: no block is held but the prefix cache's, and once that is
    flushed no llama.cpp sequence (request, tree leaf or cache holder) holds a cell."""
    engine.step()  # executes the KV operations the last finished requests left pending
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    if engine.cache is None:
        assert stats.kv_blocks.used == 0
    else:
        assert stats.kv_blocks.used == stats.prefix_cache.blocks > 0
        engine.flush_prefix_cache()
        engine.step()
        assert engine.stats().kv_blocks.used == 0
    backend = engine.backend
    held = [s for s in range(backend.config.n_seq_max) if backend.seq_pos_max(s) != -1]
    assert held == [], f"sequences {held} still hold KV"


def assert_mostly_identical(pairs, what: str) -> None:
    """``pairs``: [(prompt, (ref, ref_logprobs), (got, got_logprobs))]. Every divergence is a
    near tie of the reference (batch-shape noise); at least half come out identical."""
    exact = 0
    for prompt, (ref, ref_lp), (got, got_lp) in pairs:
        assert len(got) == len(ref)
        ok, why = divergence_is_noise(ref, ref_lp, got, got_lp)
        assert ok, f"{what}, {prompt!r}: {why}"
        exact += got == ref
    assert exact >= math.ceil(len(pairs) / 2), f"{what}: only {exact}/{len(pairs)} identical"


# ---- 1, 2: each proposer is lossless, accepts drafts, and leaves the KV clean ------------

@pytest.mark.model
@pytest.mark.parametrize("name", ["ngram", "draft", "tree"])
def test_greedy_speculation_matches_plain_decoding(name, request, reference, monkeypatch):
    engine: Engine = request.getfixturevalue(name)
    leaf_seqs: set[int] = set()
    settle = engine.scheduler.settle

    def recording_settle(chunk, path):
        leaf_seqs.update(chunk.leaf_seqs)
        settle(chunk, path)

    monkeypatch.setattr(engine.scheduler, "settle", recording_settle)
    start = engine.stats().spec
    pairs = []
    for prompt in PROMPTS:
        before = engine.stats().spec
        tokens, logprobs, steps = run_counting(engine, prompt, GREEDY)
        drafts, drafted, accepted = delta(engine, before)
        assert len(tokens) == N
        # Every step emits its accepted drafts plus the target's own token; only the last step
        # can end on an accepted draft (max_tokens reached) and so emit one fewer.
        assert steps + accepted - 1 <= len(tokens) <= steps + accepted, (steps, accepted)
        assert 0 <= accepted <= drafted
        if prompt == REPETITIVE:
            assert drafts > 0 and accepted > 0
            assert steps < len(tokens), f"{steps} steps for {len(tokens)} tokens"
        pairs.append((prompt, reference(prompt), (tokens, logprobs)))
    assert_mostly_identical(pairs, name)
    drafts, drafted, accepted = delta(engine, start)
    assert drafts > 0 and 0 < accepted <= drafted
    if name == "tree":
        # Trees really branched: extra leaves were verified in sequences of their own.
        assert leaf_seqs, "no tree with more than one leaf was verified"
    assert_kv_clean(engine)  # the leaves' sequences included


# ---- 3: a tree whose right branch is not the first one ------------------------------------

def margin(lp) -> float:
    """How far the greedy token is ahead of the runner-up, in nats."""
    return lp.logprob - lp.top[1][1]


@pytest.fixture(scope="module")
def tree_reference(tree):
    """The same engine decoding REPETITIVE plainly (spec_n_max=0: no drafts), computed once."""
    memo = {}

    def get(params):
        if params not in memo:
            memo[params] = run_alone(tree, REPETITIVE, params)
        return memo[params]

    return get


@pytest.mark.model
@pytest.mark.parametrize("shape", ["wrong_first", "right_first", "wrong_at_depth_2"])
def test_tree_verification_follows_the_right_branch(shape, tree, tree_reference, monkeypatch):
    n = 32
    params = SamplingParams(max_tokens=n, logprobs=5, ignore_eos=True, spec_n_max=0)
    ref, ref_lp = tree_reference(params)
    assert len(ref) == n
    # Inject at a step whose next three tokens are clear of any near tie, so the tree step's
    # batch shape cannot flip them.
    k = next(i for i in range(1, n - 8)
             if all(margin(ref_lp[j]) > NEAR_TIE_NATS for j in (i, i + 1, i + 2)))
    t1, t2, t3 = ref[k:k + 3]
    if shape == "wrong_first":  # the first leaf is wrong: the winner is copied from a leaf seq
        wrong = ref_lp[k].top[1][0]
        draft = DraftTree((wrong, t1, t2), (-1, -1, 1))
    elif shape == "right_first":  # the first leaf is right: the extra leaf is just dropped
        wrong = ref_lp[k].top[1][0]
        draft = DraftTree((t1, t2, wrong), (-1, 0, -1))
    else:  # the branches part below a shared, accepted node
        wrong = ref_lp[k + 1].top[1][0]
        draft = DraftTree((t1, wrong, t2), (-1, 0, 0))
    assert wrong not in (t1, t2)

    rid = tree.add_request(REPETITIVE, params)
    tokens, logprobs = [], []

    def step():
        outs = [o for o in tree.step() if o.request_id == rid]
        assert len(outs) == 1 and outs[0].error is None
        tokens.extend(outs[0].token_ids)
        logprobs.extend(outs[0].logprobs)
        return outs[0]

    while len(tokens) < k:
        assert len(step().token_ids) == 1
    assert tokens == ref[:k]  # the same computation so far
    req = tree.scheduler.running[0]
    pos = req.num_computed_tokens  # the last token (ref[k-1]) sits here, uncomputed
    before = tree.stats().spec
    verified = []
    settle = tree.scheduler.settle
    with monkeypatch.context() as m:
        m.setattr(tree, "_propose", lambda: {rid: draft})
        m.setattr(tree.scheduler, "settle", lambda c, p: (verified.append((c, list(p))),
                                                          settle(c, p)))
        out = step()
    assert out.token_ids == [t1, t2, t3]  # two drafts accepted plus the target's next token
    assert delta(tree, before) == (1, 3, 2)
    (chunk, path), = verified
    assert len(chunk.leaf_seqs) == 1 and [draft.tokens[i] for i in path] == [t1, t2]
    leaf = chunk.leaf_seqs[0]
    assert req.num_computed_tokens == pos + 3  # root, t1, t2; t3 is next

    step()  # applies the settle's KV ops, then decodes t3 at pos + 3 in the request's sequence
    assert tree.backend.seq_pos_max(req.seq_id) == pos + 3 == req.num_computed_tokens - 1
    assert tree.backend.seq_pos_max(leaf) == -1
    while not step().finished:
        pass
    # The rest was computed over the accepted path's KV: the plain run's tokens, with
    # log-probabilities within the noise bound (KV of the wrong branch would move them).
    assert len(tokens) == n
    ok, why = divergence_is_noise(ref, ref_lp, tokens, logprobs)
    assert ok, why
    assert_kv_clean(tree)


@pytest.mark.model
@pytest.mark.parametrize("name", ["tree", "ngram"])
def test_abort_while_a_draft_is_verified_frees_everything(name, request, reference, monkeypatch):
    """The request is aborted (from another thread, as the server does) while llama.cpp computes
    its draft: the cells written into its sequence and its tree's extra leaf go, its blocks
    are free, and the next request, on one of those sequence ids, gets plain outputs."""
    engine: Engine = request.getfixturevalue(name)
    draft = (DraftTree((1, 2, 3), (-1, -1, 1)) if name == "tree"  # two leaves
             else DraftTree.chain([1, 2, 3]))
    rid = engine.add_request(REPETITIVE, SamplingParams(max_tokens=N, ignore_eos=True))
    while not engine.step():  # the prompt, then the request decodes
        pass
    decode = engine.backend.decode
    in_flight = []

    def aborting_decode(n_tokens, split=0):  # the batch is filled; llama_decode runs unlocked
        assert engine.abort(rid)
        in_flight.append(n_tokens)
        return decode(n_tokens, split)

    with monkeypatch.context() as m:
        m.setattr(engine, "_propose", lambda: {rid: draft})
        m.setattr(engine.backend, "decode", aborting_decode)
        assert engine.step() == []  # nothing is emitted for an aborted request
    assert in_flight == [4]  # the last token and the three drafts
    assert_kv_clean(engine)
    # The next request takes a sequence id the aborted step wrote to, and sees none of it.
    prompt = PROMPTS[2]
    tokens, logprobs, _ = run_counting(engine, prompt, GREEDY)
    ok, why = divergence_is_noise(*reference(prompt), tokens, logprobs)
    assert ok, why
    assert_kv_clean(engine)


@pytest.mark.model
def test_abort_from_another_thread_waits_until_the_batch_is_filled(model_path, monkeypatch):
    """An abort arriving between planning and filling the batch used to leave a chunk whose
    request had no sequence id (TypeError, every request failed). Planning and filling now
    happen under the engine lock: the abort waits, then lands while llama_decode runs."""
    import threading

    engine = Engine(EngineConfig(model=model_path, spec="ngram", prefix_cache=False, **BASE))
    try:
        rid = engine.add_request(REPETITIVE, SamplingParams(max_tokens=N, ignore_eos=True))
        other = engine.add_request(STORY, SamplingParams(max_tokens=N, ignore_eos=True))
        while not engine.step():
            pass
        prepare = engine.runner.prepare
        aborted = threading.Event()
        seen: list[bool] = []

        def prepare_with_an_abort_in_flight(plan):
            t = threading.Thread(target=lambda: (engine.abort(rid), aborted.set()))
            t.start()
            seen.append(aborted.wait(0.5))  # must not get through while we hold the lock
            return prepare(plan)

        with monkeypatch.context() as m:
            m.setattr(engine.runner, "prepare", prepare_with_an_abort_in_flight)
            outs = engine.step()
        assert seen == [False] and aborted.wait(30)
        assert all(o.error is None for o in outs) and rid not in {o.request_id for o in outs}
        while engine.has_unfinished():
            for o in engine.step():
                assert o.error is None and o.request_id == other
        assert_kv_clean(engine)
    finally:
        engine.close()


def test_a_draft_never_preempts_another_request():
    """schedule(): drafts are cut to the free KV blocks (speculation never preempts anyone).
    Pure scheduler: two running requests each need one more block for their next token and
    two are free; a draft for the first must not cost the second its place."""
    from justllm.core.request import Request
    from justllm.core.scheduler import Scheduler, SchedulerConfig
    from justllm.kv.block_pool import BlockPool

    def plan_with(drafts):
        s = Scheduler(SchedulerConfig(max_seqs=2, chunk_size=16, n_batch=16),
                      BlockPool(total_blocks=4, block_size=4))
        a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=8), 0, 100)
        b = Request("b", [5, 6, 7, 8], SamplingParams(max_tokens=8), 1, 100)
        s.add(a)
        s.add(b)
        s.update(s.schedule())  # both prompts in the KV: one block each, two free
        a.output_token_ids.append(9)
        b.output_token_ids.append(10)
        return s.schedule(drafts)

    plain = plan_with(None)
    assert plain.preempted == [] and [len(c.token_ids) for c in plain.chunks] == [1, 1]
    spec = plan_with({"a": DraftTree.chain([11, 12, 13, 14])})
    assert spec.preempted == []
    assert [c.request.request_id for c in spec.chunks] == ["a", "b"]


# ---- 4: many requests speculating in one batch -----------------------------------------

@pytest.mark.model
@pytest.mark.parametrize("name", ["ngram", "tree"])
def test_concurrent_speculating_requests(name, request, reference, monkeypatch):
    engine: Engine = request.getfixturevalue(name)
    greedy = PROMPTS
    sampled = [REPETITIVE, STORY, "import numpy as np\n"]
    reqs = [(p, GREEDY) for p in greedy] + [
        (p, SamplingParams(max_tokens=N, temperature=0.8, seed=s, ignore_eos=True))
        for s, p in enumerate(sampled)]
    drafts_per_step = []
    schedule = engine.scheduler.schedule

    def recording_schedule(drafts=None):
        plan = schedule(drafts)
        drafts_per_step.append(sum(c.draft is not None for c in plan.chunks))
        return plan

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    before = engine.stats().spec
    results = run_mixed(engine, reqs)
    assert [len(t) for t, _ in results] == [N] * len(reqs)
    assert_mostly_identical([(p, reference(p), r) for p, r in zip(greedy, results)],
                            f"{name}, 8 at once")
    drafts, drafted, accepted = delta(engine, before)
    assert drafts > 0 and 0 < accepted <= drafted
    assert max(drafts_per_step) >= 2, "never two drafts verified in one step"
    assert_kv_clean(engine)


# ---- 5: sampled requests --------------------------------------------------------------

@pytest.mark.model
@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_sampled_speculation_is_valid_and_reproducible(name, request):
    engine: Engine = request.getfixturevalue(name)
    params = SamplingParams(max_tokens=N, temperature=0.8, seed=1234, ignore_eos=True)
    before = engine.stats().spec
    runs = []
    for _ in range(2):
        # No prefix-cache hit: both runs compute the prompt the same way.
        engine.flush_prefix_cache()
        runs.append(run_alone(engine, REPETITIVE, params)[0])
    assert len(runs[0]) == N and all(0 <= t < engine.backend.n_vocab for t in runs[0])
    assert runs[0] == runs[1]
    drafts, drafted, accepted = delta(engine, before)
    assert drafts > 0 and accepted <= drafted  # sampled requests were speculated on too
    # ... and the seed matters.
    engine.flush_prefix_cache()
    a, _ = run_alone(engine, STORY, params)
    engine.flush_prefix_cache()
    b, _ = run_alone(engine, STORY, SamplingParams(max_tokens=N, temperature=0.8, seed=99,
                                                   ignore_eos=True))
    assert len(a) == len(b) == N and a != b
    assert_kv_clean(engine)


# ---- 6: per-request control ------------------------------------------------------------

@pytest.mark.model
def test_per_request_spec_n_max(ngram, reference):
    ref = reference(REPETITIVE)
    runs = {}
    gamma = ngram.config.gamma
    for n_max in (0, 1, gamma):
        params = SamplingParams(max_tokens=N, logprobs=5, ignore_eos=True, spec_n_max=n_max)
        ngram.flush_prefix_cache()
        before = ngram.stats().spec
        tokens, logprobs, steps = run_counting(ngram, REPETITIVE, params)
        runs[n_max] = delta(ngram, before), steps
        ok, why = divergence_is_noise(ref[0], ref[1], tokens, logprobs)
        assert ok, f"spec_n_max={n_max}: {why}"
    (d0, steps0), (d1, _), (dg, _) = runs[0], runs[1], runs[gamma]
    assert d0 == (0, 0, 0) and steps0 == N  # off for this request: plain decoding
    assert d1[0] > 0 and d1[1] == d1[0]  # one draft token per step
    assert dg[0] > 0 and dg[0] < dg[1] <= gamma * dg[0]
    # More than the engine's --gamma was capped without a word; n-gram drafts take no p_min.
    for refused in (dict(spec_n_max=gamma + 1), dict(spec_p_min=0.5)):
        with pytest.raises(InvalidRequestError, match="speculative") as e:
            ngram.add_request(REPETITIVE, SamplingParams(max_tokens=2, **refused))
        assert e.value.param in ("speculative.n_max", "speculative.p_min")
    assert_kv_clean(ngram)


@pytest.mark.parametrize("kw", [dict(spec_n_max=-1), dict(spec_n_max=99), dict(spec_n_max=1.5),
                                dict(spec_p_min=2), dict(spec_p_min=-0.1)])
def test_invalid_spec_params_are_refused(kw):
    with pytest.raises(InvalidRequestError, match="speculative") as e:
        SamplingParams(**kw)
    assert e.value.param.startswith("speculative.")


# ---- 7: configuration errors -------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(spec="draft"), "--spec draft needs --draft-model"),
    (dict(spec="tree"), "--spec tree needs --draft-model"),
    (dict(spec="bogus"), "spec must be one of ngram, draft, tree"),
    (dict(spec="ngram", gamma=0), r"gamma must be an integer in \[1, 16\] \(got 0\)"),
    (dict(spec="ngram", gamma=17), r"gamma must be an integer in \[1, 16\] \(got 17\)"),
    (dict(spec="tree", draft_model="x.gguf", branch=0), r"branch must be an integer in \[1, 4\]"),
    (dict(spec="ngram", gamma=2.5), r"gamma must be an integer in \[1, 16\] \(got 2.5\)"),
    (dict(spec="tree", draft_model="x.gguf", branch=True), r"branch must be an integer"),
    (dict(spec="draft", draft_model="x.gguf", draft_p_min=1.5), r"draft_p_min must be in \[0, 1\]"),
])
def test_spec_config_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m.gguf", **kw)


# ---- 8: a draft model must share the target's vocabulary ---------------------------------

def tiny_llama(path: Path, extra_tokens: list[str]) -> Path:
    """A loadable one-block llama with a ~260-token SentencePiece vocabulary (bytes, three
    specials and ``extra_tokens``) and random weights: it loads, tokenizes and decodes."""
    rng = np.random.default_rng(0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + extra_tokens
    types = [2, 3, 3] + [6] * 256 + [1] * len(extra_tokens)
    n_vocab, d, ff = len(tokens), 32, 64
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d // 2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w.add_tensor("token_embd.weight", weight(n_vocab, d))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.add_tensor("output.weight", weight(n_vocab, d))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(d, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(d, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        w.add_tensor(f"blk.0.{name}.weight", weight(d, d))
    w.add_tensor("blk.0.ffn_gate.weight", weight(ff, d))
    w.add_tensor("blk.0.ffn_up.weight", weight(ff, d))
    w.add_tensor("blk.0.ffn_down.weight", weight(d, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def closes_backends(monkeypatch):
    """Every LlamaBackend created in the test, closed at its end whatever the engine did."""
    made: list[LlamaBackend] = []
    init = LlamaBackend.__init__

    def tracking_init(self, config):
        made.append(self)
        init(self, config)

    monkeypatch.setattr(LlamaBackend, "__init__", tracking_init)
    yield made
    for b in made:
        b.close()


@pytest.mark.model
def test_draft_with_another_vocabulary_is_refused(model_path, tmp_path, closes_backends):
    other = tiny_llama(tmp_path / "tiny.gguf", ["▁the", "▁cat"])
    with pytest.raises(ModelLoadError, match="different vocabulary from the target"):
        Engine(EngineConfig(model=model_path, spec="draft", draft_model=str(other), **BASE))
    target, draft_backend = closes_backends
    assert draft_backend._ctx is None  # the refused draft was closed


def test_same_size_vocabulary_with_other_token_texts_is_refused(tmp_path, closes_backends):
    """Token texts count, not only the vocabulary size (tiny models: no demo model needed)."""
    a = tiny_llama(tmp_path / "a.gguf", ["▁the", "▁cat"])
    b = tiny_llama(tmp_path / "b.gguf", ["▁the", "▁dog"])
    kw = dict(max_seqs=2, pool_blocks=8, threads=1)
    with pytest.raises(ModelLoadError, match="different vocabulary"):
        Engine(EngineConfig(model=str(a), spec="draft", draft_model=str(b), **kw))
    # The same vocabulary in another file is accepted, and drafts for it.
    same = tiny_llama(tmp_path / "a2.gguf", ["▁the", "▁cat"])
    eng = Engine(EngineConfig(model=str(a), spec="draft", draft_model=str(same), **kw))
    try:
        tokens, _ = run_alone(eng, "the cat", SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(tokens) == 8 and eng.stats().spec.num_drafts > 0
    finally:
        eng.close()


def test_refused_draft_leaves_no_backend_open(tmp_path, closes_backends):
    a = tiny_llama(tmp_path / "a.gguf", ["▁the", "▁cat"])
    b = tiny_llama(tmp_path / "b.gguf", ["▁the", "▁dog"])
    with pytest.raises(ModelLoadError):
        Engine(EngineConfig(model=str(a), spec="draft", draft_model=str(b), max_seqs=2,
                            pool_blocks=8, threads=1))
    assert [bk._ctx is None for bk in closes_backends] == [True, True]


def test_a_load_cancelled_while_the_draft_loads_stops_it_and_closes_both(
        tmp_path, closes_backends, monkeypatch):
    """serve stopping while a --spec draft engine loads: the draft's load is cancelled too
    (it ran to its end before the stop took effect), and neither model is left open."""
    import justllm.engine.engine as engine_module
    from justllm.errors import LoadCancelled

    a = tiny_llama(tmp_path / "a.gguf", ["▁the", "▁cat"])
    b = tiny_llama(tmp_path / "b.gguf", ["▁the", "▁cat"])
    stopping: list[bool] = []
    real = engine_module.make_proposer

    def stop_once_the_target_is_in(config, target):
        stopping.append(True)  # the server's shutdown comes now
        return real(config, target)

    monkeypatch.setattr(engine_module, "make_proposer", stop_once_the_target_is_in)
    with pytest.raises(LoadCancelled):
        Engine(EngineConfig(model=str(a), spec="draft", draft_model=str(b), max_seqs=2,
                            pool_blocks=8, threads=1), cancel=lambda: bool(stopping))
    assert len(closes_backends) == 2 and [bk._ctx is None for bk in closes_backends] == [True, True]


# ---- 9: a `justllm draft make` draft: bad, and still lossless -------------------------

@pytest.mark.model
def test_layer_truncated_draft_is_lossless(made, reference):
    before = made.stats().spec
    pairs = [(p, reference(p), run_alone(made, p, GREEDY)) for p in PROMPTS]
    assert_mostly_identical(pairs, "6-layer draft")
    drafts, drafted, accepted = delta(made, before)
    assert drafts > 0
    # A weak draft: some of its tokens were rejected, and outputs are still the target's.
    assert accepted < drafted
    assert_kv_clean(made)


# ---- 7: a thinking budget forces the end of thinking through the drafts ------------------

THINKING = "".join(f"Q: {q}\nA: <think>\nI know this one, {q} is easy.\n</think>\n\n{a}\n\n"
                   for q, a in (("two plus two", "4"), ("three plus three", "6"),
                                ("four plus four", "8"))) + "Q: five plus five\nA: <think>\n"


@pytest.mark.model
@pytest.mark.parametrize("name", ["plain", "ngram", "draft"])
def test_a_thinking_budget_forces_the_end_tag_while_drafts_are_verified(name, request):
    """The engine's thinking budget (core/thinking_budget.py) with each proposer: the first
    ``budget`` tokens are the model's own, then the end tag's tokens are forced (the drafts,
    which would go on thinking, are rejected there), then the model answers."""
    engine = request.getfixturevalue(name)
    budget = 3
    closing = engine.backend.tokenize("\n</think>\n\n", add_special=False)
    params = SamplingParams(max_tokens=N, ignore_eos=True, thinking_budget=budget,
                            thinking_tags=("<think>", "</think>"), thinking_open=True)
    engine.flush_prefix_cache()
    before = engine.stats().spec
    tokens, _ = run_alone(engine, THINKING, params)
    free, _ = run_alone(engine, THINKING, SamplingParams(max_tokens=N, ignore_eos=True))
    assert tokens[:budget] == free[:budget]  # the model's own thinking, as without a budget
    assert tokens[budget:budget + len(closing)] == closing  # then the end, forced
    assert free[budget:budget + len(closing)] != closing  # (which it would not have written)
    text = engine.backend.detokenize(tokens)
    assert "\n</think>\n\n" in text and len(tokens) == N
    if name != "plain":
        assert delta(engine, before)[0] > 0  # it drafted
    assert_kv_clean(engine)


@pytest.mark.model
def test_the_draft_model_takes_the_targets_micro_batch_and_flash_attention(model_path):
    """The draft's context was made with llama.cpp's defaults: a micro-batch of the whole
    step (4x the compute buffers the GPU's memory plan counted) and flash attention auto
    whatever --flash-attn said."""
    engine = Engine(EngineConfig(model=model_path, spec="draft", draft_model=model_path,
                                 n_ubatch=64, flash_attn="off", **BASE))
    try:
        draft = engine.spec.proposer.backend.config
        assert (draft.n_ubatch, draft.flash_attn) == (64, "off")
        assert (engine.backend.config.n_ubatch, engine.backend.config.flash_attn) == (64, "off")
    finally:
        engine.close()
