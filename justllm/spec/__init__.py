"""Speculative decoding: proposers of draft tokens and lossless verification (pure numpy).

Not wired into the engine yet (issue #5): the scheduler will put the last token plus the draft
into the step's batch with logits on every row, and ``verify`` decides what is kept.
"""
