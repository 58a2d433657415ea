"""What the routes share: the server state, a request's admission, prompt tokenization."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from fastapi import Request
from pydantic import BaseModel

from quantkit.serve.errors import APIError
from quantkit.serve.fields import check_body
from quantkit.serve.protocol import Prompt
from quantkit.serve.state import ServerState

log = logging.getLogger("quantkit.serve")


def server(request: Request) -> ServerState:
    return request.app.state.server


class Admitted(NamedTuple):
    state: ServerState
    engine: Any  # the ready LLMEngine (read-only use)
    model: str  # the served model name the response reports


def admit(request: Request, body: BaseModel, endpoint: str) -> Admitted:
    """What a generation or embedding route does first: the engine must be ready (503), the body's `model` one of
    the served names (404), and every field of the body one `endpoint` honours (400; quantkit.serve.fields)."""
    state = server(request)
    engine = state.require_ready()
    model = state.check_model(body.model)
    check_body(body, endpoint)
    return Admitted(state, engine, model)


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """On the event loop, with its own tokenizer (`ServerState.tokenizer`), never the engine thread's."""
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


def prompt_token_ids(tokenizer, prompt: Prompt, param: str = "prompt",
                     add_special_tokens: bool = True) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists -> token id lists. `param`: the
    field's name in a 400 (`input` for embeddings)."""
    if isinstance(prompt, str):
        prompts = [encode(tokenizer, prompt, add_special_tokens)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [encode(tokenizer, p, add_special_tokens) for p in prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    if not prompts or any(not p for p in prompts):
        raise APIError(400, f"{param} must not be empty", param=param)
    return prompts


def check_token_ids(tokenizer, prompts: list[list[int]], param: str = "prompt") -> None:
    """As vLLM, after the context-length check: ids past the tokenizer's are a 400 (before anything decodes
    them, as `echo` does)."""
    vocab = len(tokenizer)
    if (bad := next((t for p in prompts for t in p if not 0 <= t < vocab), None)) is not None:
        raise APIError(400, f"Token id {bad} is out of vocabulary [0, {vocab})", param=param)


def log_user(body, request_id: str) -> None:
    """OpenAI's `user` and `safety_identifier`: logged with the request id (an operator's way to trace abuse)."""
    who = {k: v for k in ("user", "safety_identifier") if (v := getattr(body, k, None))}
    if who:
        log.info("%s: %s", request_id, " ".join(f"{k}={v!r}" for k, v in who.items()))
