"""Terminal dashboards: ``justllm top`` watches a running server through its ``/metrics``."""
