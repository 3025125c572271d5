"""A refused HTTP answer's body as one short line, for the clients here (chat --url, bench):
a JSON error's message, an HTML page's title (a proxy's error page was printed whole), else
the start of the text, its whitespace folded."""

from __future__ import annotations

import contextlib
import html
import json
import re

_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(r"<[^>]*>")
MOST = 200  # characters of what the server said


def error_text(status: int, body: bytes, content_type: str = "") -> str:
    """What the server said in a refusal, in one line of at most ``MOST`` characters; ""
    when it said nothing. JSON is read whatever ``content_type`` says (servers label it
    loosely); its ``error`` (OpenAI's object, Ollama's string) or ``detail``."""
    text = body[:65536].decode("utf-8", "replace")
    said: str | None = None
    with contextlib.suppress(ValueError):
        data = json.loads(text)
        if isinstance(data, dict) and ("error" in data or "detail" in data):
            error = data.get("error", data.get("detail"))
            said = str(error.get("message", error) if isinstance(error, dict) else error or "")
    if said is None and ("html" in content_type or text.lstrip().startswith("<")):
        title = _TITLE.search(text)
        said = html.unescape(title.group(1) if title else _TAG.sub(" ", text))
        # (a page's title repeats the status: "502 Bad Gateway"; a message's own digits stay)
        said = " ".join(said.split()).removeprefix(f"{status} ")
    said = " ".join((text if said is None else said).split())
    return said[:MOST - 1] + "…" if len(said) > MOST else said
