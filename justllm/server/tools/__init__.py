"""Tool calling on chat completions, as pure functions (no I/O, no engine): the request's
tools checked and resolved (``request``), the grammar that forces a call (``grammar``), and a
model's answer split into content and calls, whole (``parse``) or while it streams
(``stream``). ``server/openai_serving.py`` wires them to the engine."""
