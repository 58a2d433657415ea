"""What the routes share: the server state, prompt tokenization."""

from __future__ import annotations

import logging

from fastapi import Request

from quantkit.serve.errors import APIError
from quantkit.serve.protocol import Prompt
from quantkit.serve.state import ServerState

log = logging.getLogger("quantkit.serve")


def server(request: Request) -> ServerState:
    return request.app.state.server


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
