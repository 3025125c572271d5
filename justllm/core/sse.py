"""Reading a server-sent event stream's lines, as the clients here (chat --url, bench) do."""

from __future__ import annotations


def sse_data(line: str) -> str:
    """A server-sent event line's data: after ``data:`` and one optional space, as the SSE
    spec reads it (``data:{...}`` without the space was skipped); "" for any other line."""
    if not line.startswith("data:"):
        return ""
    data = line[5:]
    return data[1:] if data.startswith(" ") else data
