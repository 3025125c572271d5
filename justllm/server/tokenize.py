"""``POST /tokenize`` and ``POST /detokenize``, as vLLM and llama-server offer them.

Clients count a prompt's tokens before they send it, or show what a model reads. Both servers
put these routes at the root; their bodies differ, and one route takes either:

- vLLM: ``prompt`` (tokenized as ``/v1/completions`` tokenizes it: ``add_special_tokens``,
  default true, adds BOS), or ``messages`` (with ``tools``, ``add_generation_prompt``,
  ``continue_final_message``, ``chat_template_kwargs``: rendered exactly as
  ``/v1/chat/completions`` renders them, so ``count`` is that request's
  ``usage.prompt_tokens``); ``return_token_strs`` adds each token's vocabulary text. The
  answer: ``count``, ``max_model_len``, ``tokens``, ``token_strs``.
- llama-server: ``content``, ``add_special`` (default false), ``parse_special`` (default
  true), ``with_pieces`` (each token as ``{"id", "piece"}``, the piece a string, or its bytes
  when they are not whole UTF-8).

``/detokenize`` takes ``tokens`` and answers the text under both servers' keys (``prompt``:
vLLM's, ``content``: llama-server's), special tokens written as their text, as both do.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Router, post
from litestar.datastructures import State
from litestar.params import JSONBody

from justllm.errors import InvalidRequestError
from justllm.server.app import _served, decode_request, require_api_key
from justllm.server.openai_serving import check_chat_request, text_size
from justllm.server.schemas import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from justllm.server.tools.request import check_tool_messages, tool_plan

_CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
              "chat_template_kwargs")


def check_tokenize(req: TokenizeRequest) -> tuple[ChatCompletionRequest | None, bool]:
    """The request's checks that need no model: exactly one of ``prompt``, ``messages`` and
    ``content``; the chat fields only with ``messages``; the two names of "add special
    tokens" not at odds. Returns the chat request to render (None for text) and whether BOS
    is added to text."""
    given = [name for name in ("prompt", "messages", "content") if getattr(req, name) is not None]
    if len(given) != 1:
        raise InvalidRequestError(
            "give exactly one of prompt, messages (vLLM's forms) and content (llama-server's)"
            + (f"; this request has {' and '.join(given)}" if given else ""),
            param=given[1] if len(given) > 1 else "prompt")
    add = req.add_special_tokens
    if add is None:
        add = req.add_special
    elif req.add_special is not None and req.add_special != add:
        raise InvalidRequestError("add_special_tokens and add_special disagree (they are one "
                                  "setting: vLLM's and llama-server's name)", param="add_special")
    if req.messages is None:
        for name in (*_CHAT_ONLY, "continue_final_message"):
            if getattr(req, name) not in (None, False):
                raise InvalidRequestError(f"{name} goes with messages (the chat form)",
                                          param=name)
        return None, add if add is not None else req.prompt is not None
    if add:
        raise InvalidRequestError(
            "add_special_tokens: true with messages would add a second BOS: the tokens given "
            "are the prompt /v1/chat/completions gives the model, BOS included",
            param="add_special_tokens")
    if not req.parse_special:
        raise InvalidRequestError("parse_special: false does not go with messages (the chat "
                                  "template's markers are special tokens)", param="parse_special")
    # add_generation_prompt: false alone (the conversation as it stands, vLLM's) is the
    # tokenizer's to honour; the chat route takes it only with continue_final_message.
    alone = req.add_generation_prompt is False and not req.continue_final_message
    chat = ChatCompletionRequest(
        model=req.model, messages=req.messages, tools=req.tools, tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        add_generation_prompt=None if alone else req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs)
    check_chat_request(chat)
    check_tool_messages(chat.messages)
    tool_plan(chat)
    return chat, False


def check_detokenize(req: DetokenizeRequest) -> None:
    """What needs no model: no negative id (the vocabulary's size is the model's)."""
    bad = next((i for i, t in enumerate(req.tokens) if t < 0), None)
    if bad is not None:
        raise InvalidRequestError(f"tokens[{bad}]: {req.tokens[bad]} is not a token id",
                                  param="tokens")


def _piece(data: bytes) -> str | list[int]:
    """llama-server's piece: the text, or its bytes where they are not whole UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


@post("/tokenize", status_code=200,
      summary="Tokenize a prompt or a chat (vLLM's and llama-server's bodies)")
async def tokenize(data: JSONBody[TokenizeRequest], request: Request, state: State) -> dict:
    served = _served(state)
    req = await decode_request(request, TokenizeRequest)
    served.completions.check_model(req.model)
    chat, add_special = check_tokenize(req)
    aengine = served.aengine

    def work() -> dict[str, Any]:
        if chat is not None:
            tokens = aengine.tokenize(served.completions.request_prompt(
                chat, generation_prompt=req.add_generation_prompt is not False))
        else:
            text = req.prompt if req.prompt is not None else req.content
            assert text is not None  # check_tokenize: one of the two
            tokens = aengine.tokenize(text, add_special=add_special,
                                      parse_special=req.parse_special)
        return {"count": len(tokens), "max_model_len": aengine.max_request_tokens,
                "tokens": ([{"id": t, "piece": _piece(aengine.token_bytes(t, special=True))}
                            for t in tokens] if req.with_pieces else tokens),
                "token_strs": [aengine.token_text(t) for t in tokens]
                if req.return_token_strs else None}

    # Off the event loop: megabytes of text take seconds, and every stream would wait.
    return await aengine.off_loop(text_size(req), work)


@post("/detokenize", status_code=200,
      summary="The text of token ids (vLLM's `prompt`, llama-server's `content`)")
async def detokenize(data: JSONBody[DetokenizeRequest], request: Request,
                     state: State) -> dict:
    served = _served(state)
    req = await decode_request(request, DetokenizeRequest)
    served.completions.check_model(req.model)
    text = await served.aengine.off_loop(len(req.tokens),
                                         lambda: served.aengine.detokenize(req.tokens))
    return {"prompt": text, "content": text}


def tokenize_router() -> Router:
    return Router(path="/", route_handlers=[tokenize, detokenize], guards=[require_api_key])
