"""``/v1/models`` in the API the client speaks.

OpenAI's SDK and Anthropic's share the path; Anthropic's sends an ``anthropic-version`` header
and expects its own shape (``type``, ``display_name``, an RFC 3339 ``created_at``; a page with
``has_more``, ``first_id`` and ``last_id``, cut by ``limit``, ``after_id`` and ``before_id``).
The OpenAI cards are the source; this only reshapes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from litestar import Request

from justllm.server.errors import APIError


def speaks_anthropic(request: Request) -> bool:
    return "anthropic-version" in request.headers


def anthropic_card(card: dict[str, Any]) -> dict[str, Any]:
    made = datetime.fromtimestamp(int(card.get("created") or 0), tz=UTC)
    return {"type": "model", "id": card["id"], "display_name": card["id"],
            "created_at": made.strftime("%Y-%m-%dT%H:%M:%SZ")}


def anthropic_page(query: Mapping[str, str], cards: list[dict[str, Any]]) -> dict[str, Any]:
    """Anthropic's page of ``cards`` (in their order) for a request's paging parameters."""
    ids = [c["id"] for c in cards]
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 1000:
        raise APIError(400, "limit must be an integer in [1, 1000]", param="limit")
    after, before = query.get("after_id"), query.get("before_id")
    for name, at in (("after_id", after), ("before_id", before)):
        if at is not None and at not in ids:
            raise APIError(400, f"{name}: no model '{at}'", param=name)
    window = cards[ids.index(after) + 1 if after is not None else 0:
                   ids.index(before) if before is not None else len(cards)]
    # before_id alone pages backwards: the models just before it
    chosen = window[-limit:] if before is not None and after is None else window[:limit]
    data = [anthropic_card(c) for c in chosen]
    more = len(chosen) < len(window)
    return {"data": data, "has_more": more, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def listing(request: Request, openai: dict[str, Any]) -> dict[str, Any]:
    """``GET /v1/models``: OpenAI's listing as given, or Anthropic's page of it."""
    if speaks_anthropic(request):
        return anthropic_page(request.query_params, openai["data"])
    return openai


def card(request: Request, openai: dict[str, Any]) -> dict[str, Any]:
    """``GET /v1/models/{model}``: OpenAI's card as given, or Anthropic's."""
    return anthropic_card(openai) if speaks_anthropic(request) else openai


def one_model(cards: list[dict], model_id: str) -> dict:
    """``GET /v1/models/{model}`` (the OpenAI SDK's ``models.retrieve``): the card of
    ``/v1/models`` whose id, or one of whose aliases, is ``model_id``; else OpenAI's 404."""
    model_id = model_id.lstrip("/")  # a path parameter keeps its leading slash
    for c in cards:
        if c["id"] == model_id or model_id in c.get("aliases", ()):
            return c
    raise APIError(404, f"the model '{model_id}' does not exist", type="not_found_error",
                   param="model", code="model_not_found")

