"""Where model files come from and where they are kept.

``source``: a model name as a user gives it → the GGUF path to load (a path, a registry name, a
file in the models directory, a Hugging Face ``REPO[:FILE]``, or the bundled demo model).
``registry``: named, versioned models in the models directory (``justllm models/tag/rm/show``),
over ``refs`` (``NAME[:TAG]`` and digests), ``manifest`` (one version on disk), ``digests``
(sha256 remembered by size and mtime) and ``lease`` (running models' claims). ``store``: the
GGUF files in the models directory. ``hub``: downloads through huggingface-hub (``justllm
pull``). ``gguf``: the one GGUF check. ``draft``: ``justllm draft make``, a layer-truncated copy
of a GGUF to use as a speculative draft. ``convert``: ``justllm convert``, a Hugging Face
safetensors model to a GGUF through llama.cpp's own converter (``converter`` fetches it from the
llama-cpp-python sdist and runs it in a child, ``converter_process``; ``hf_model`` reads and
checks the model folder or repo listing).
"""
