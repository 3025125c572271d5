"""A plugin that fails to import: justllm must report it in one line and go on."""

raise ImportError("justllm_broken needs a library that is not installed")
