"""Router mode: one OpenAI endpoint in front of several models, each in its own runner process
(a single-model ``justllm serve``) started on demand, unloaded when idle and restarted when it
dies. ``config`` reads models.yaml, ``policy`` holds the pure decisions, ``runner`` owns one
process, ``supervisor`` the set of them, ``app`` the HTTP gateway."""
