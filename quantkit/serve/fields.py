"""Every request field of /v1/chat/completions and /v1/completions, honoured or refused: no field is silently ignored.

The table holds OpenAI's fields (the official client's `CompletionCreateParams` of both endpoints; a test walks them,
so a new field in a new client release fails until it is classified here), vLLM's extras and llama-server's
structured-output names. A refused field, given with a value other than null or one of the values that mean what
this server does anyway (`store: false`, `modalities: ["text"]`), is a 400 that names it; so is a field the table
does not know.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from quantkit.serve.errors import APIError

CHAT, COMPLETIONS = "chat", "completions"
BOTH = (CHAT, COMPLETIONS)


@dataclass(frozen=True)
class RequestField:
    name: str
    endpoints: tuple[str, ...]
    honoured: bool
    why: str  # how it is honoured, or why it is refused
    harmless: tuple = ()  # values of a refused field that ask for nothing this server does not do


def _honoured(names: str, endpoints: tuple[str, ...], why: str) -> list[RequestField]:
    return [RequestField(n, endpoints, True, why) for n in names.split()]


def _refused(names: str, endpoints: tuple[str, ...], why: str, harmless: tuple = ()) -> list[RequestField]:
    return [RequestField(n, endpoints, False, why, harmless) for n in names.split()]


FIELDS: dict[str, RequestField] = {f.name: f for f in [
    # OpenAI's, both endpoints
    *_honoured("model", BOTH, "one of --served-model-name (404 otherwise)"),
    *_honoured("max_tokens n stop seed temperature top_p presence_penalty frequency_penalty stream stream_options",
               BOTH, "sampling and streaming, as OpenAI defines them"),
    *_honoured("logit_bias", BOTH, "added to the logits before sampling (token ids of this model's tokenizer)"),
    *_honoured("logprobs", BOTH, "the sampled tokens' log-probabilities and top alternatives"),
    *_honoured("user safety_identifier", BOTH, "logged with the request id"),
    # OpenAI's, chat
    *_honoured("messages", (CHAT,), "through the chat template"),
    *_honoured("max_completion_tokens top_logprobs", (CHAT,), "as OpenAI defines them"),
    *_honoured("response_format", (CHAT, COMPLETIONS), "text, json_object or json_schema, enforced by a token mask"),
    *_honoured("tools tool_choice parallel_tool_calls", (CHAT,),
               "tools reach the chat template; required and a named tool are enforced by a token mask; auto needs "
               "--enable-auto-tool-choice --tool-call-parser"),
    *_honoured("prompt_cache_key", (CHAT,), "prefix caching is automatic for every request; the key is a hint"),
    *_refused("prompt_cache_retention", (CHAT,), "the prefix cache lives in memory only", ("in_memory",)),
    *_refused("prompt_cache_options", (CHAT,), "the prefix cache has no options per request"),
    *_refused("audio", (CHAT,), "this server writes text only"),
    *_refused("modalities", (CHAT,), "this server writes text only", (["text"],)),
    *_refused("functions function_call", (CHAT,), "the deprecated function calling: use tools and tool_choice"),
    *_refused("metadata", (CHAT,), "this server stores no completions"),
    *_refused("store", (CHAT,), "this server stores no completions", (False,)),
    *_refused("moderation", (CHAT,), "this server runs no moderation"),
    *_refused("prediction", (CHAT,), "predicted outputs are not supported (see --speculative-config)"),
    *_refused("reasoning_effort verbosity", (CHAT,), "this server has no reasoning or verbosity controls"),
    *_refused("service_tier", (CHAT,), "this server has one tier", ("auto", "default")),
    *_refused("web_search_options", (CHAT,), "this server does not search the web"),
    # OpenAI's, completions
    *_honoured("prompt echo", (COMPLETIONS,), "as OpenAI defines them"),
    *_honoured("best_of", (COMPLETIONS,), "best_of samples, the n of highest cumulative logprob returned"),
    *_refused("suffix", (COMPLETIONS,), "fill-in-the-middle is not supported"),
    # vLLM's extras
    *_honoured("top_k min_p repetition_penalty ignore_eos min_tokens stop_token_ids include_stop_str_in_output "
               "skip_special_tokens spaces_between_special_tokens return_tokens_as_token_ids", BOTH,
               "vLLM's sampling extras"),
    *_honoured("prompt_logprobs", BOTH, "vLLM's: the top alternatives of each prompt token (not with stream)"),
    *_honoured("structured_outputs guided_json guided_regex guided_choice guided_grammar", BOTH,
               "vLLM's structured outputs, enforced by a token mask"),
    *_honoured("add_generation_prompt continue_final_message chat_template_kwargs", (CHAT,),
               "passed to the chat template"),
    *_refused("use_beam_search length_penalty", BOTH, "beam search is not supported", (False,)),
    *_refused("allowed_token_ids bad_words logits_processors", BOTH, "not supported: use logit_bias"),
    *_refused("truncate_prompt_tokens", BOTH, "prompts are never truncated: a long one is a 400"),
    *_refused("guided_decoding_backend guided_whitespace_pattern structural_tag", BOTH,
              "one grammar engine (llguidance) with a fixed JSON layout"),
    *_refused("priority", BOTH, "the scheduler is first come, first served", (0,)),
    *_refused("request_id cache_salt kv_transfer_params vllm_xargs return_token_ids", BOTH,
              "vLLM's engine internals, not this engine's"),
    *_refused("add_special_tokens", BOTH, "the chat template writes the special tokens; completions always add BOS"),
    *_refused("documents chat_template mm_processor_kwargs", (CHAT,),
              "documents, a per-request chat template and multimodal inputs are not supported"),
    *_refused("include_reasoning", (CHAT,), "this server has no reasoning parser", (False,)),
    # llama-server's
    *_honoured("json_schema grammar", BOTH, "llama-server's structured outputs, enforced by a token mask"),
]}


def endpoint_fields(endpoint: str) -> dict[str, RequestField]:
    return {name: f for name, f in FIELDS.items() if endpoint in f.endpoints}


def refuse_unsupported(body: BaseModel, endpoint: str) -> None:
    """A 400 naming the first field of `body` that this endpoint does not honour (refused, unknown, or the other
    endpoint's), unless its value is null or harmless."""
    known = endpoint_fields(endpoint)
    extra = body.model_extra or {}
    for name in sorted(body.model_fields_set | set(extra)):
        value = extra[name] if name in extra else getattr(body, name)
        spec = known.get(name)
        if spec is not None and spec.honoured:
            continue
        if value is None or (spec is not None and value in spec.harmless):
            continue
        if spec is not None:
            raise APIError(400, f"{name} is not supported: {spec.why}", param=name)
        other = FIELDS.get(name)
        where = f" (it belongs to /v1/{other.endpoints[0].replace('chat', 'chat/completions')})" if other else ""
        raise APIError(400, f"{name} is not a field of this endpoint{where}; unknown fields are refused, not ignored",
                       param=name)
