"""Schemathesis hooks for tests/server/test_schemathesis.py (loaded through SCHEMATHESIS_HOOKS).

Generated bodies keep their shape, but ``max_tokens`` (``max_output_tokens`` on /v1/responses)
becomes small (1-8) so that the requests that are accepted finish quickly, and most lose their
random ``model`` (which would be a 404) so that generation paths are reached too.
"""

import schemathesis


@schemathesis.hook
def map_body(ctx, body):
    if isinstance(body, dict):
        if isinstance(body.get("model"), str) and len(body["model"]) % 4:
            del body["model"]
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                body[key] = 1 + value % 8
    return body
