"""Stored responses for OpenAI's Responses API: ``store`` (OpenAI's default), ``GET`` and
``DELETE /v1/responses/{id}``, and ``previous_response_id``, which continues a stored
response's conversation.

A response is kept with its conversation: the input items it answered (its own
``previous_response_id``'s conversation first) and then its output items, which the API takes
back as input items. ``instructions`` are not part of it: as in OpenAI's API, a continued
response has only the instructions it is sent with.

The store lives in the server's memory only (a restart forgets it, as vLLM's does) and is
bounded: at most ``max_responses`` responses and ``max_bytes`` of their JSON, the least
recently used dropped first. A dropped response is not found, as if it had never been stored.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from justllm.errors import InvalidRequestError

MAX_RESPONSES = 1024
MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Stored:
    response: bytes  # the response object's JSON, as GET answers it
    conversation: list[dict[str, Any]]  # input items, then its output items
    inputs: int  # how many of them are input items
    size: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response_id: str, response: bytes, conversation: list[dict[str, Any]],
            inputs: int | None = None) -> None:
        """Keep a response (replacing one of that id), then drop the least recently used ones
        past the bounds; one larger than ``max_bytes`` alone is not kept. ``inputs``: how
        many of the conversation's items are its input (default: all)."""
        self.delete(response_id)
        size = len(response) + len(msgspec.json.encode(conversation))
        if size > self.max_bytes:
            return
        n = len(conversation) if inputs is None else inputs
        self._kept[response_id] = Stored(response, conversation, n, size)
        self._bytes += size
        while len(self._kept) > self.max_responses or self._bytes > self.max_bytes:
            _, dropped = self._kept.popitem(last=False)
            self._bytes -= dropped.size

    def get(self, response_id: str) -> Stored | None:
        found = self._kept.get(response_id)
        if found is not None:
            self._kept.move_to_end(response_id)
        return found

    def delete(self, response_id: str) -> bool:
        found = self._kept.pop(response_id, None)
        if found is None:
            return False
        self._bytes -= found.size
        return True


_ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
             "reasoning": "rs"}


def listed(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as OpenAI lists a response's input items (and still an input item): its
    ``type``, an ``id`` (given, else a new one), a ``status``, and a message's text as parts
    (``input_text``, an assistant's ``output_text``). An item already listed is unchanged."""
    kind = item.get("type", "message")
    out = {**item, "type": kind, "id": item.get("id") or f"{_ITEM_IDS.get(kind, 'item')}_"
           f"{uuid.uuid4().hex}", "status": item.get("status") or "completed"}
    if kind == "message" and isinstance(item.get("content"), str):
        part = ({"type": "output_text", "text": item["content"], "annotations": []}
                if item.get("role") == "assistant" else
                {"type": "input_text", "text": item["content"]})
        out["content"] = [part]
    return out


def unstored(path: str, body: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``/v1/responses`` (or ``/input_tokens``) body as a router forwards it (``where``:
    router mode, the cluster): a model's replicas each keep their own store, which a later
    request may not reach, so nothing is stored there -- ``store`` goes as false, and
    ``store: true`` and ``previous_response_id`` are refused rather than answered by whichever
    replica the request lands on."""
    path = path.removeprefix("/v1")  # llama-server's paths without /v1 too
    if not path.startswith("/responses"):
        return body
    if body.get("previous_response_id") is not None:
        raise InvalidRequestError(f"previous_response_id: responses are not stored in {where} "
                                  "(each replica would keep its own); send the whole "
                                  "conversation in input", param="previous_response_id")
    if path == "/responses":
        if body.get("store"):
            raise InvalidRequestError(f"store: responses are not stored in {where}; send "
                                      "store: false (or leave it out) and the whole "
                                      "conversation in input", param="store")
        body = {**body, "store": False}
    return body
