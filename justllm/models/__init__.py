"""Where model files come from and where they are kept.

``source``: a model name as a user gives it → the GGUF path to load (a path, a name in the models
directory, a Hugging Face ``REPO[:FILE]``, or the bundled demo model). ``store``: the local models
directory (``justllm models``). ``hub``: downloads through huggingface-hub (``justllm pull``).
``draft``: ``justllm draft make``, a layer-truncated copy of a GGUF to use as a speculative draft.
"""
