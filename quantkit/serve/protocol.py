"""Request bodies of the OpenAI-compatible API (OpenAI's field names plus vLLM's and llama-server's extras).

Unknown fields are kept (`model_extra`) for the generation routes to refuse with a 400 that names them
(quantkit.serve.fields: no field is silently ignored); the other bodies log and ignore them. Responses are plain
dicts built in `quantkit.serve.responses`, so their JSON is exactly what the wire format says.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger("quantkit.serve")


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self):
        if self.model_extra:
            log.debug("%s: ignoring unknown fields %s", type(self).__name__, sorted(self.model_extra))
        return self


class JSONSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # enforced either way: the mask holds the output to the schema


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """The fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of `user`
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (exact, unlike their text)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as text) -> bias in [-100, 100]
    prompt_logprobs: int | None = None  # vLLM's: the top alternatives of every prompt token
    # structured outputs, under every name clients use (quantkit.serve.structured: at most one per request)
    response_format: ResponseFormat | None = None  # OpenAI's
    structured_outputs: dict[str, Any] | None = None  # vLLM's {json | regex | choice | grammar}
    guided_json: str | dict | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: dict | None = None  # llama-server's
    grammar: str | None = None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool = False
    best_of: int | None = None  # generate best_of, return the n of highest cumulative logprob
    logprobs: int | None = None  # the number of top alternatives per token (0..20)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class MessageToolCall(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)  # vLLM's join of text parts
        return self.content


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # enforced either way under "required" or a named tool


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    prompt_cache_key: str | None = None  # a routing hint: prefix caching is automatic for every request


class TokenizeCompletion(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChat(OpenAIModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None  # rendered by the chat template, as /v1/chat/completions renders them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]
