"""POST /tokenize and /detokenize (vLLM's bodies)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ValidationError

from quantkit.serve.chat_template import render_chat
from quantkit.serve.errors import APIError
from quantkit.serve.protocol import DetokenizeRequest, TokenizeChat, TokenizeCompletion
from quantkit.serve.routes.common import encode, server

router = APIRouter()


async def _json_object(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as exc:
        raise APIError(400, f"the body is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


@router.post("/tokenize")
async def tokenize(request: Request):
    state = server(request)
    engine = state.require_ready()
    raw = await _json_object(request)
    try:
        body = TokenizeChat(**raw) if "messages" in raw else TokenizeCompletion(**raw)
    except ValidationError as exc:
        raise APIError(400, str(exc.errors()[0]["msg"]), param=".".join(map(str, exc.errors()[0]["loc"]))) from exc
    state.check_model(body.model)
    if isinstance(body, TokenizeChat):
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        text = render_chat(state.tokenizer, body.messages, state.settings.chat_template, body.add_generation_prompt,
                           body.continue_final_message, tools=tools)
    else:
        text = body.prompt
    tokens = encode(state.tokenizer, text, add_special_tokens=body.add_special_tokens)
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = server(request)
    state.require_ready()
    state.check_model(body.model)
    vocab = len(state.tokenizer)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}
