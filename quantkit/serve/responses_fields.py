"""Every request field of /v1/responses, classified: honoured, or refused with a 400 that names it.

OpenAI's request type (`openai.types.responses.ResponseCreateParams`) grows with each client release; a field this
server does not act on must never be accepted and dropped, because the caller would get a 200 that ignores what it
asked for. So each field is in `FIELDS`, and a test walks the client's TypedDict and fails on a field that is not.

A refused field is still accepted at the value that asks for nothing (null, false, its default): clients send such
defaults unasked. Any field not in the table is refused too (OpenAI's "Unrecognized request argument").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quantkit.serve.errors import APIError

STATELESS = "this server is stateless: it stores no responses or conversations"


@dataclass(frozen=True)
class FieldRule:
    honoured: bool
    accepts: Callable[[Any], bool] = lambda value: True  # the values taken (a refused field: those that ask nothing)
    why: str = ""  # why other values are refused


def _off(value) -> bool:
    """null, false, empty, or an object all of whose values are null (clients send `reasoning: {"effort": null}`)."""
    if isinstance(value, dict):
        return all(v is None for v in value.values())
    return value is None or value is False or value == [] or value == ""


def _one_of(*values) -> Callable[[Any], bool]:
    return lambda value: value is None or value in values


def _honoured() -> FieldRule:
    return FieldRule(True)


def _refused(why: str, accepts: Callable[[Any], bool] = _off) -> FieldRule:
    return FieldRule(False, accepts, why)


FIELDS: dict[str, FieldRule] = {
    "model": _honoured(),
    "input": _honoured(),
    "instructions": _honoured(),  # a system message before the input
    "max_output_tokens": _honoured(),
    "temperature": _honoured(),
    "top_p": _honoured(),
    "text": _honoured(),  # format: text, json_object, json_schema (the engine's structured outputs); verbosity medium
    "tools": _honoured(),  # function tools
    "tool_choice": _honoured(),
    "parallel_tool_calls": _honoured(),  # false: at most one call
    "max_tool_calls": _honoured(),  # calls past it are not returned (held to it by the mask under "required")
    "stream": _honoured(),
    "stream_options": _honoured(),  # include_obfuscation: delta events carry the random padding field
    "metadata": _honoured(),  # echoed in the response, as OpenAI does
    "user": _honoured(),  # logged with the request
    "safety_identifier": _honoured(),  # logged with the request
    "store": _honoured(),  # accepted either way; nothing is stored (see STATELESS)
    "truncation": FieldRule(True, _one_of("disabled"), "only 'disabled' (a prompt past the context is a 400)"),
    "service_tier": FieldRule(True, _one_of("auto", "default"), "this server has one service tier"),
    "prompt_cache_key": _honoured(),  # a routing hint: the prefix cache is automatic and shared by all requests
    "prompt_cache_retention": FieldRule(True, _one_of("in_memory"),
                                        "the prefix cache lives in memory, for as long as its blocks are free"),
    "top_logprobs": _refused("log probabilities are not returned by /v1/responses here; use /v1/chat/completions",
                             _one_of(0)),
    "include": _refused("no extra output data is available (no logprobs, reasoning or tool results)"),
    "previous_response_id": _refused(f"{STATELESS}; send the whole conversation as input items"),
    "conversation": _refused(f"{STATELESS}; send the whole conversation as input items"),
    "background": _refused(f"{STATELESS}, so it cannot run a response in the background"),
    "background_options": _refused(f"{STATELESS}, so it cannot run a response in the background"),
    "prompt": _refused("stored prompt templates are not available here; send the prompt as input"),
    "reasoning": _refused("this server runs no reasoning-effort or reasoning-summary control"),
    "context_management": _refused("this server does not compact the context"),
    "prompt_cache_options": _refused("prompt-cache breakpoints are not configurable; the prefix cache is automatic"),
    "moderation": _refused("this server runs no moderation"),
    "image": _refused("this server takes no images"),
    "access_programs": _refused("access programs are OpenAI's"),
}


def check_fields(body: dict) -> None:
    """A 400 naming the first field of `body` that is unknown or asks for what this server does not do."""
    for name, value in body.items():
        rule = FIELDS.get(name)
        if rule is None:
            raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name)
        if not rule.accepts(value):
            raise APIError(400, f"{name}: {value!r} is not supported: {rule.why}", param=name)
