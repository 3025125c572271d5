"""The engine: llama.cpp backend, step runner, sampling, detokenizing, sync and async engines."""
