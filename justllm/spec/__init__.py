"""Speculative decoding, the pure part: the proposer interface and prompt lookup
(``proposer.py``), lossless verification of chains and trees (``verify.py``), and each request's
adaptive draft window (``window.py``). No llama.cpp here: the draft-model proposer, a second
llama.cpp context, lives in ``justllm/engine/draft_model.py``, and the scheduler puts drafts into
the step's batch (``core/scheduler.py``)."""
