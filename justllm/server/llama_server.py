"""llama-server's own routes beside its OpenAI ones, for clients written against it.

- ``GET /props``: what the server is and does by default (llama-server's fields that have a
  meaning here: the context a request may fill, the sampling a ``/completion`` request that
  sets nothing gets, the slots (``--max-seqs``), the model's name, path and chat template,
  BOS and EOS, the build). Clients read ``default_generation_settings.n_ctx`` and
  ``chat_template`` from it.
  Changing them (llama-server's ``POST /props``, off there unless ``--props``) is not offered.
  ``?model=`` (what router mode forwards) must name the served model or one of its adapters,
  as a body's ``model`` must (404 otherwise); ``/slots`` takes it too.
- ``GET /slots``: the ``--max-seqs`` slots, busy ones first (justllm keeps no fixed slots:
  slot ``i`` is the ``i``-th running request), with llama-server's counts and sampling;
  ``?fail_on_no_slot=1`` answers 503 when none is idle (what load balancers ask). The prompt
  and the text so far, which llama-server adds, are left out: they are other clients' data.
  Saving, restoring and erasing a slot (``POST /slots/{id}``) are not offered: a 400 that
  says so.
- ``POST /apply-template``: a chat request's prompt as the chat template renders it for
  ``/v1/chat/completions`` (tools and ``chat_template_kwargs`` included), as ``{"prompt"}``;
  a conversation that ends with an assistant message ends inside it, as llama-server prefills
  it (``continue_final_message`` without asking; the chat route keeps vLLM's new turn). The
  body is checked as the chat route checks it (a body it refuses is the same 400, in
  llama-server's shape); ``stream`` and ``truncate_prompt_tokens``, which the answer cannot
  honour, are a 400.
- ``POST /completion`` and ``POST /completions``: llama-server's native completion
  (server/llama_completion.py).
- ``POST /infill``: fill-in-the-middle on a model with FIM tokens (server/infill.py).
- ``POST /embedding`` and ``POST /embeddings``: its native embeddings (server/llama_embedding.py).
- ``GET`` and ``POST /lora-adapters``: its global adapter scales (server/lora.py).
- ``/chat/completions``, ``/responses``, ``/responses/input_tokens`` and ``/v1/health``: llama-server serves its OpenAI
  routes with and without ``/v1`` (an OpenAI SDK given ``http://host:8080`` as its base URL
  posts to ``/chat/completions``); its un-prefixed ``/completions`` and ``/embeddings`` are
  its native formats, not OpenAI's (above).

The errors of llama-server's own routes are in its shape, ``{"error": {code, message, type}}``
with ``param`` besides (server/errors.py); its OpenAI routes keep OpenAI's.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Router, get, post
from litestar.datastructures import State
from litestar.params import FromPath, FromQuery, JSONBody

from justllm import build_info
from justllm.errors import InvalidRequestError
from justllm.server.app import (
    _served,
    chat_completions,
    decode_request,
    list_models,
    require_api_key,
    retrieve_model,
)
from justllm.server.errors import APIError
from justllm.server.llama_completion import DEFAULT_SAMPLERS
from justllm.server.openai_serving import OpenAIServing, check_chat_request, text_size
from justllm.server.schemas import ChatCompletionRequest
from justllm.server.tools.request import check_tool_messages, tool_plan

# What a /completion request that sets nothing is sampled with (llama-server's /props gives
# its /completion defaults), in llama-server's names; n_predict -1: until the context is full
# or the model ends. The OpenAI routes keep OpenAI's defaults (temperature 1, no cuts).
DEFAULT_PARAMS: dict[str, Any] = {
    "n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
    "repeat_penalty": 1.0, "repeat_last_n": 64, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "seed": -1, "stop": [], "ignore_eos": False, "n_probs": 0,
    "samplers": list(DEFAULT_SAMPLERS)}


@get("/props", summary="llama-server's /props: the context, default sampling, slots, template")
async def props(state: State, model: FromQuery[str | None] = None) -> dict[str, Any]:
    served = _served(state)
    served.completions.check_model(model)  # ?model= (router mode's): this one, or a 404
    aengine, template = served.aengine, served.completions.template
    return {
        "default_generation_settings": {"n_ctx": aengine.max_request_tokens,
                                        "params": DEFAULT_PARAMS},
        "total_slots": aengine.engine.config.max_seqs,
        "model_alias": served.model_id,
        "model_path": aengine.model_path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True,
        "endpoint_props": False,  # POST /props (changing these) is not offered
        "endpoint_metrics": True,
        "chat_template": template.source,
        "bos_token": template.bos_token,
        "eos_token": template.eos_token,
        "build_info": build_info(),
        "is_sleeping": False,
    }


@get("/slots", summary="llama-server's /slots: the slots (--max-seqs), busy or idle")
async def slots(state: State, fail_on_no_slot: FromQuery[str | None] = None,
                model: FromQuery[str | None] = None) -> list[dict[str, Any]]:
    served = _served(state)
    served.completions.check_model(model)
    engine = served.aengine.engine
    busy = engine.busy_requests()
    total = engine.config.max_seqs
    if fail_on_no_slot and len(busy) >= total:
        raise APIError(503, "no slot available", type="unavailable_error")
    common = {"n_ctx": served.aengine.max_request_tokens,
              "speculative": engine.spec is not None}
    out: list[dict[str, Any]] = []
    for i in range(total):
        slot: dict[str, Any] = {"id": i, **common, "is_processing": i < len(busy)}
        if i < len(busy):
            r = busy[i]
            p = r.params
            slot.update({
                "id_task": r.arrival,
                "n_prompt_tokens": r.n_prompt,
                "n_prompt_tokens_processed": r.n_prompt_computed - r.n_prompt_cached,
                "n_prompt_tokens_cache": r.n_prompt_cached,
                "params": {"n_predict": -1 if p.max_tokens is None else p.max_tokens,
                           "seed": -1 if p.seed is None else p.seed,
                           "temperature": p.temperature, "top_k": p.top_k, "top_p": p.shown_top_p,
                           "min_p": p.min_p, "stop": list(p.stop),
                           "ignore_eos": p.ignore_eos},
                "next_token": [{"has_next_token": True, "n_decoded": r.n_decoded,
                                "n_remain": -1 if p.max_tokens is None
                                else p.max_tokens - r.n_decoded}]})
        out.append(slot)
    return out


@post("/apply-template", status_code=200,
      summary="llama-server's /apply-template: a chat request's prompt, rendered")
async def apply_template(data: JSONBody[ChatCompletionRequest], request: Request,
                         state: State) -> dict[str, str]:
    served = _served(state)
    chat = await decode_request(request, ChatCompletionRequest)
    served.completions.check_model(chat.model)
    chat, generation_prompt = check_apply_template(chat)
    completions = served.completions

    def render() -> str:
        # Every check the chat route runs before it queues the request (its sampling,
        # response_format, grammars, tools; the engine's: priority, the context, the
        # grammar's compilation), so a body it refuses is the same 400 here.
        jobs, _ = completions.chat_jobs(chat)
        completions._prepare(jobs[:1], None)  # (its other choices differ by their seed)
        completions.reasoning_format(chat)
        if generation_prompt:
            return str(jobs[0][0])  # the prompt the chat route renders, rendered once
        return completions.request_prompt(chat, generation_prompt=False)

    return {"prompt": await served.aengine.off_loop(text_size(chat), render)}


# Chat fields /apply-template cannot honour: its answer is one prompt, whole and not streamed.
_NOT_APPLIED = {
    "stream": "/apply-template answers the prompt as one JSON object, not a stream",
    "truncate_prompt_tokens": "/apply-template answers the whole prompt (/tokenize with "
                              "messages gives its tokens, which the client may cut)",
}


def check_apply_template(chat: ChatCompletionRequest) -> tuple[ChatCompletionRequest, bool]:
    """The checks that need no model (router mode runs them before a load): the chat route's.
    Returns the request to render and whether the assistant's opening ends the prompt:
    ``add_generation_prompt: false`` alone is the conversation as it stands (as /tokenize
    reads it), where the chat route takes it only with ``continue_final_message``."""
    for name, why in _NOT_APPLIED.items():
        value = getattr(chat, name)
        if value is not None and value is not False:  # (truncate_prompt_tokens 0 too)
            raise InvalidRequestError(f"{name}: {why}", param=name)
    chat = prefill_assistant(chat)
    alone = chat.add_generation_prompt is False and not chat.continue_final_message
    if alone:
        chat = msgspec.structs.replace(chat, add_generation_prompt=None)
    check_chat_request(chat)
    OpenAIServing.check_supported(chat)
    OpenAIServing.check_extras(chat)
    check_tool_messages(chat.messages)
    tool_plan(chat)
    return chat, not alone


def prefill_assistant(chat: ChatCompletionRequest) -> ChatCompletionRequest:
    """llama-server's assistant prefill (on unless it runs with ``--no-prefill-assistant``): a
    conversation that ends with an assistant message is continued, as if it had asked for
    ``continue_final_message`` (its ``add_generation_prompt`` then false, whatever was sent);
    two assistant messages at the end, or one with tool calls, cannot be."""
    messages = chat.messages
    if chat.continue_final_message or not messages or messages[-1].role != "assistant":
        return chat
    if len(messages) > 1 and messages[-2].role == "assistant":
        raise InvalidRequestError("the conversation ends with two assistant messages: the last "
                                  "one is continued, so it must follow another role",
                                  param="messages")
    if messages[-1].tool_calls:
        raise InvalidRequestError("the last message is an assistant message with tool calls, "
                                  "which cannot be continued", param="messages")
    return msgspec.structs.replace(chat, continue_final_message=True, add_generation_prompt=False)


def slots_body(model: str | None) -> dict[str, str]:
    """What a router (router mode, the cluster) forwards ``/slots`` with: the model that
    ``?model=`` names; a router has no slots of its own, so without one it is a 400."""
    if model is None:
        raise APIError(400, "model: name the model whose slots to show (/slots?model=NAME)",
                       param="model")
    return {"model": model}


@post("/slots/{id_slot:str}", status_code=200, include_in_schema=False,
      summary="llama-server's slot save, restore and erase: not offered")
async def slot_action(id_slot: FromPath[str], action: FromQuery[str | None] = None) -> None:
    """llama-server's ``POST /slots/{id}?action=save|restore|erase`` (a slot's KV to a file
    and back). justllm has no fixed slots to save: a 400 that says what it has instead (it
    was a bare 404). Routers answer it alike."""
    raise InvalidRequestError(
        f"slot actions ({action or 'save, restore, erase'}) are not offered: justllm keeps no "
        "fixed slots; every request's prompt goes through one prefix cache, shared by all "
        "(--cache-ram keeps more of it in host memory)", param="action")


def router_props() -> dict[str, Any]:
    """``/props`` of a server of several models asked without ``?model=`` (router mode, the
    cluster), as llama-server's router answers it: its role and build, and the fields its web
    UI reads, empty."""
    return {"role": "router", "model_alias": "justllm", "model_path": "none",
            "default_generation_settings": {"params": {}, "n_ctx": 0},
            "build_info": build_info()}


def llama_server_router() -> Router:
    """The routes above and the un-prefixed OpenAI aliases, behind ``--api-key``."""
    from justllm.server import lora, responses
    from justllm.server.infill import infill
    from justllm.server.llama_completion import completion
    from justllm.server.llama_embedding import embedding

    return Router(path="/", route_handlers=[props, slots, slot_action, apply_template,
                                            completion, infill,
                                            embedding,
                                            chat_completions, responses.create_response,
                                            responses.input_tokens, list_models,
                                            retrieve_model,
                                            *lora.LLAMA_SERVER_ROUTES],
                  guards=[require_api_key])
