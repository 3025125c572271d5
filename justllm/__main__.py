"""``python -m justllm`` is the ``justllm`` command."""

from justllm.cli import main

main()
