"""Every request field of every generation and embedding endpoint, honoured or refused: no field is silently ignored.

One table, `FIELDS`, keyed by endpoint, and one check, `check_fields`: a field the endpoint does not know, or a
refused field given a value that asks for something, is a 400 in OpenAI's error shape that names it (`param`).

The table holds OpenAI's fields (the official client's request types of each endpoint; tests walk them, so a new
field in a new client release fails until it is classified here), vLLM's extras and llama-server's structured-output
names. A refused field is still accepted at a value that asks for nothing this server does not do (null, and per
field `store: false`, `modalities: ["text"]`, `reasoning: {"effort": null}`...): clients send such defaults unasked.
Some honoured fields take only some values (/v1/responses' `truncation: "disabled"`). An unknown field given null
asks for nothing either, and passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from quantkit.serve.errors import APIError

CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS = "chat", "completions", "responses", "embeddings"
BOTH = (CHAT, COMPLETIONS)
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions", RESPONSES: "/v1/responses",
         EMBEDDINGS: "/v1/embeddings"}
STATELESS = "this server is stateless: it stores no responses or conversations"
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # /v1/responses' `include` that asks for output logprobs


def _anything(value) -> bool:
    return True


def _off(value) -> bool:
    """null, false, empty, or an object all of whose values are null (clients send `reasoning: {"effort": null}`)."""
    if isinstance(value, dict):
        return all(v is None for v in value.values())
    return value is None or value is False or value == [] or value == ""


def _one_of(*values) -> Callable[[Any], bool]:
    return lambda value: value is None or value in values


@dataclass(frozen=True)
class RequestField:
    name: str
    honoured: bool
    why: str = ""  # why the values `accepts` refuses are refused (for an honoured field, how it is honoured)
    accepts: Callable[[Any], bool] = _anything  # the values taken (a refused field: those that ask for nothing)


@dataclass(frozen=True)
class _Rows:
    """Table rows: `names` (space-separated) on `endpoints`, each field alike."""
    names: str
    endpoints: tuple[str, ...]
    honoured: bool
    why: str
    accepts: Callable[[Any], bool]


def _honoured(names: str, endpoints: tuple[str, ...], why: str = "", accepts: Callable[[Any], bool] = _anything):
    return _Rows(names, endpoints, True, why, accepts)


def _refused(names: str, endpoints: tuple[str, ...], why: str, accepts: Callable[[Any], bool] = _one_of()):
    """`accepts` defaults to null only; `_one_of(v, ...)` adds the harmless values, `_off` every empty one."""
    return _Rows(names, endpoints, False, why, accepts)


ROWS: list[_Rows] = [
    # OpenAI's, chat and completions
    _honoured("model", BOTH, "one of --served-model-name (404 otherwise)"),
    _honoured("max_tokens n stop seed temperature top_p presence_penalty frequency_penalty stream stream_options",
              BOTH, "sampling and streaming, as OpenAI defines them"),
    _honoured("logit_bias", BOTH, "added to the logits before sampling (token ids of this model's tokenizer)"),
    _honoured("logprobs", BOTH, "the sampled tokens' log-probabilities and top alternatives"),
    _honoured("user safety_identifier", BOTH, "logged with the request id"),
    _honoured("response_format", BOTH, "text, json_object or json_schema, enforced by a token mask"),
    # OpenAI's, chat
    _honoured("messages", (CHAT,), "through the chat template"),
    _honoured("max_completion_tokens top_logprobs", (CHAT,), "as OpenAI defines them"),
    _honoured("tools tool_choice parallel_tool_calls", (CHAT,),
              "tools reach the chat template; required and a named tool are enforced by a token mask; auto needs "
              "--enable-auto-tool-choice --tool-call-parser"),
    _honoured("prompt_cache_key", (CHAT,), "prefix caching is automatic for every request; the key is a hint"),
    _refused("prompt_cache_retention", (CHAT,), "the prefix cache lives in memory only", _one_of("in_memory")),
    _refused("prompt_cache_options", (CHAT,), "the prefix cache has no options per request"),
    _refused("audio", (CHAT,), "this server writes text only"),
    _refused("modalities", (CHAT,), "this server writes text only", _one_of(["text"])),
    _refused("functions function_call", (CHAT,), "the deprecated function calling: use tools and tool_choice"),
    _refused("metadata", (CHAT,), "this server stores no completions"),
    _refused("store", (CHAT,), "this server stores no completions", _one_of(False)),
    _refused("moderation", (CHAT,), "this server runs no moderation"),
    _refused("prediction", (CHAT,), "predicted outputs are not supported (see --speculative-config)"),
    _refused("reasoning_effort verbosity", (CHAT,), "this server has no reasoning or verbosity controls"),
    _refused("service_tier", (CHAT,), "this server has one tier", _one_of("auto", "default")),
    _refused("web_search_options", (CHAT,), "this server does not search the web"),
    # OpenAI's, completions
    _honoured("prompt echo", (COMPLETIONS,), "as OpenAI defines them"),
    _honoured("best_of", (COMPLETIONS,), "best_of samples, the n of highest cumulative logprob returned"),
    _refused("suffix", (COMPLETIONS,), "fill-in-the-middle is not supported"),
    # vLLM's extras
    _honoured("top_k min_p repetition_penalty ignore_eos min_tokens stop_token_ids include_stop_str_in_output "
              "skip_special_tokens spaces_between_special_tokens return_tokens_as_token_ids", BOTH,
              "vLLM's sampling extras"),
    _honoured("prompt_logprobs", BOTH, "vLLM's: the top alternatives of each prompt token (not with stream)"),
    _honoured("structured_outputs guided_json guided_regex guided_choice guided_grammar", BOTH,
              "vLLM's structured outputs, enforced by a token mask"),
    _honoured("add_generation_prompt continue_final_message chat_template_kwargs", (CHAT,),
              "passed to the chat template"),
    _refused("use_beam_search length_penalty", BOTH, "beam search is not supported", _one_of(False)),
    _refused("allowed_token_ids bad_words logits_processors", BOTH, "not supported: use logit_bias"),
    _refused("truncate_prompt_tokens", BOTH, "prompts are never truncated: a long one is a 400"),
    _refused("guided_decoding_backend guided_whitespace_pattern structural_tag", BOTH,
             "one grammar engine (llguidance) with a fixed JSON layout"),
    _refused("priority", BOTH, "the scheduler is first come, first served", _one_of(0)),
    _refused("request_id cache_salt kv_transfer_params vllm_xargs return_token_ids", BOTH,
             "vLLM's engine internals, not this engine's"),
    _refused("add_special_tokens", BOTH, "the chat template writes the special tokens; completions always add BOS"),
    _refused("documents chat_template mm_processor_kwargs", (CHAT,),
             "documents, a per-request chat template and multimodal inputs are not supported"),
    _refused("include_reasoning", (CHAT,), "this server has no reasoning parser", _one_of(False)),
    # llama-server's
    _honoured("json_schema grammar", BOTH, "llama-server's structured outputs, enforced by a token mask"),
    # /v1/responses (OpenAI's ResponseCreateParams); a refused field passes at any empty value (_off)
    _honoured("model input instructions max_output_tokens temperature top_p", (RESPONSES,),
              "instructions: a system message before the input"),
    _honoured("text", (RESPONSES,), "format: text, json_object, json_schema (a token mask); verbosity medium"),
    _honoured("tools tool_choice parallel_tool_calls", (RESPONSES,), "function tools; parallel_tool_calls false: at "
              "most one call"),
    _honoured("max_tool_calls", (RESPONSES,), "calls past it are not returned (held to it by the mask under required)"),
    _honoured("stream stream_options", (RESPONSES,), "include_obfuscation: delta events carry the random padding"),
    _honoured("metadata", (RESPONSES,), "echoed in the response, as OpenAI does"),
    _honoured("user safety_identifier", (RESPONSES,), "logged with the request"),
    _honoured("store", (RESPONSES,), f"accepted either way; nothing is stored ({STATELESS})"),
    _honoured("truncation", (RESPONSES,), "only 'disabled' (a prompt past the context is a 400)", _one_of("disabled")),
    _honoured("service_tier", (RESPONSES,), "this server has one service tier", _one_of("auto", "default")),
    _honoured("prompt_cache_key", (RESPONSES,), "a routing hint: the prefix cache is automatic and shared"),
    _honoured("prompt_cache_retention", (RESPONSES,),
              "the prefix cache lives in memory, for as long as its blocks are free", _one_of("in_memory")),
    _honoured("top_logprobs", (RESPONSES,), "0 to 20 alternatives of each output token, with include "
              "message.output_text.logprobs"),
    _honoured("include", (RESPONSES,), "only message.output_text.logprobs: no reasoning, tool results or images here",
              lambda value: value is None or (isinstance(value, list) and set(value) <= {LOGPROBS_INCLUDE})),
    _refused("previous_response_id conversation", (RESPONSES,),
             f"{STATELESS}; send the whole conversation as input items", _off),
    _refused("background background_options", (RESPONSES,),
             f"{STATELESS}, so it cannot run a response in the background", _off),
    _refused("prompt", (RESPONSES,), "stored prompt templates are not available here; send the prompt as input", _off),
    _refused("reasoning", (RESPONSES,), "this server runs no reasoning-effort or reasoning-summary control", _off),
    _refused("context_management", (RESPONSES,), "this server does not compact the context", _off),
    _refused("prompt_cache_options", (RESPONSES,),
             "prompt-cache breakpoints are not configurable; the prefix cache is automatic", _off),
    _refused("moderation", (RESPONSES,), "this server runs no moderation", _off),
    _refused("image", (RESPONSES,), "this server takes no images", _off),
    _refused("access_programs", (RESPONSES,), "access programs are OpenAI's", _off),
    # /v1/embeddings (OpenAI's EmbeddingCreateParams, and vLLM's add_special_tokens)
    _honoured("input model encoding_format user", (EMBEDDINGS,), "as OpenAI defines them"),
    _honoured("dimensions", (EMBEDDINGS,), "only the model's own size: a shorter cut needs a Matryoshka model"),
    _honoured("add_special_tokens", (EMBEDDINGS,), "vLLM's"),
]


def _table(rows: list[_Rows]) -> dict[str, dict[str, RequestField]]:
    table: dict[str, dict[str, RequestField]] = {endpoint: {} for endpoint in PATHS}
    for row in rows:
        for endpoint in row.endpoints:
            for name in row.names.split():
                assert name not in table[endpoint], f"{name} twice for {endpoint}"
                table[endpoint][name] = RequestField(name, row.honoured, row.why, row.accepts)
    return table


FIELDS: dict[str, dict[str, RequestField]] = _table(ROWS)  # endpoint -> field name -> how it is served


def check_fields(endpoint: str, given: dict[str, Any]) -> None:
    """A 400 naming the first field of `given` (name -> value, as the client sent it) that `endpoint` does not know,
    or whose value its rule does not accept; an unknown field given null passes."""
    known = FIELDS[endpoint]
    for name in sorted(given):
        value, rule = given[name], known.get(name)
        if rule is None and value is not None:
            raise APIError(400, f"{name} is not a field of {PATHS[endpoint]}{_belongs(name)}; unknown fields are "
                                "refused, not ignored", param=name)
        if rule is not None and not rule.accepts(value):
            raise APIError(400, f"{name}: {_short(value)} is not supported: {rule.why}", param=name)


def check_body(body: BaseModel, endpoint: str) -> None:
    """check_fields over a parsed body's fields (those the client set, and its unknown extras); before that, a 400
    for the first unknown field of a chat message that is not null (a response's message sent back holds `refusal`,
    `audio`, `annotations` as nulls)."""
    for i, message in enumerate(getattr(body, "messages", None) or []):
        extra = next((k for k, v in (message.model_extra or {}).items() if v is not None), None)
        if extra is not None:
            raise APIError(400, f"messages[{i}].{extra} is not supported: unknown fields are refused, not ignored",
                           param=f"messages[{i}].{extra}")
    extra = body.model_extra or {}
    check_fields(endpoint, {**{name: getattr(body, name) for name in body.model_fields_set}, **extra})


def _belongs(name: str) -> str:
    """Where an unknown field is honoured, if on another endpoint: a hint for a request sent to the wrong path."""
    home = next((e for e, fields in FIELDS.items() if name in fields and fields[name].honoured), None)
    return f" (it belongs to {PATHS[home]})" if home else ""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
