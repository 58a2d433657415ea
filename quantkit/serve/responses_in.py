"""A /v1/responses request -> the conversation the chat template renders, the tools it sees, and the
SamplingParams the engine runs (stateless: everything the model sees is in the request).

Input items (OpenAI's names), as chat messages:
  {"role", "content"} or {"type": "message", ...}   a message; developer is rendered as system; content is text
                                                    or input_text / output_text parts (joined)
  {"type": "function_call", call_id, name, arguments}   an assistant message's tool call (consecutive calls join
                                                    one message, as a chat template expects)
  {"type": "function_call_output", call_id, output}  a tool message answering that call
`instructions` is a system message before them. Anything else (images, files, item references, reasoning) is a
400 naming the item.

How tool_choice decides the output (tool_choice.plan_tools, the chat endpoint's, as vLLM does for chat):
  none       tools are not shown to the model; the output is text
  auto       the output is parsed for calls in the server's tool-call format (`tool_calls.FORMATS`)
  required   the output is held by the structured-output mask to a JSON array of calls (tool_calls.required_schema)
  named      the output is held to that function's parameter schema: it is the arguments of one call
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantkit.engine.sampling_params import SamplingParams, StructuredOutputsParams
from quantkit.errors import QuantkitError
from quantkit.serve.errors import APIError
from quantkit.serve.fields import LOGPROBS_INCLUDE
from quantkit.serve.tool_choice import ToolPlan, ToolRequest

log = logging.getLogger("quantkit.serve")


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")  # output items sent back carry id, status, annotations: descriptive


TEXT_PART_TYPES = ("input_text", "output_text")


class TextPart(_Item):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


ITEM_TYPES: dict[str, type[_Item]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                      "function_call_output": FunctionCallOutputItem}


class FunctionTool(_Item):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None

    def as_chat(self) -> dict:
        """The chat completions shape, which chat templates and tool_calls.required_schema take."""
        function = {"name": self.name, "parameters": self.parameters or {"type": "object", "properties": {}}}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None  # json_schema's
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat = TextFormat()
    verbosity: Literal["medium"] | None = None  # low and high steer a reasoning model's length: not here


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool = True


class ResponsesRequest(BaseModel):
    """The honoured fields (fields.FIELDS[RESPONSES]); the others were checked before this model is built."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    store: bool = True
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    include: list[str] | None = None  # message.output_text.logprobs only (fields.FIELDS)
    top_logprobs: int | None = Field(None, ge=0, le=20)


def validated(model: type[BaseModel], value, param: str):
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join([*([param] if param else []), *(str(p) for p in first["loc"])])
        raise APIError(400, f"{where}: {first['msg']}", param=where) from None


def input_items(raw: str | list[dict]) -> list[_Item]:
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    if not raw:
        raise APIError(400, "input must not be empty", param="input")
    items = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        model = ITEM_TYPES.get(kind)
        if model is None:
            hint = "; this server is stateless: send the items themselves" if kind == "item_reference" else ""
            raise APIError(400, f"input[{i}]: item type {kind!r} is not supported here (only "
                                f"{', '.join(ITEM_TYPES)}){hint}", param=f"input[{i}].type")
        _check_parts(item.get("content"), f"input[{i}].content")
        items.append(validated(model, item, f"input[{i}]"))
    return items


def _check_parts(content, param: str) -> None:
    """Text parts only: an image or a file is a 400 that names the part (this server's models read text)."""
    for j, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES:
            raise APIError(400, f"{param}[{j}]: content type {kind!r} is not supported here: only "
                                f"{', '.join(TEXT_PART_TYPES)}", param=f"{param}[{j}].type")


def conversation(instructions: str | None, items: list[_Item]) -> list[dict]:
    """The chat messages (dicts, as apply_chat_template takes them) of the instructions and input items."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    names = {}  # call_id -> function name (templates may name the tool a result answers)
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item.arguments)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "name": names.get(item.call_id, ""),
                             "content": item.text()})
    return messages


def _arguments(text: str):
    """A call's arguments as an object when they are JSON (chat templates write them with tojson), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def tool_request(body: ResponsesRequest) -> ToolRequest:
    """The request's tools and tool_choice in the chat endpoint's shapes, for tool_choice.plan_tools: function tools
    only, allowed_tools narrowing them; auto, the default, asks nothing without tools."""
    tools = [validated(FunctionTool, t, f"tools[{i}]").as_chat() if t.get("type") == "function"
             else _unsupported_tool(i, t) for i, t in enumerate(body.tools)]
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = {t.get("name") for t in choice.get("tools", []) if isinstance(t, dict)}
        tools = [t for t in tools if t["function"]["name"] in allowed]
        choice = choice.get("mode", "auto")
    limits = dict(parallel=body.parallel_tool_calls, max_calls=body.max_tool_calls)
    if isinstance(choice, dict):
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, f"tool_choice: {choice!r} is not supported: only none, auto, required, "
                                "{'type': 'function', 'name': ...} and allowed_tools", param="tool_choice")
        return ToolRequest(tools, "named", name, **limits)
    return ToolRequest(tools, None if choice == "auto" and not tools else choice, **limits)


def _unsupported_tool(i: int, tool: dict) -> dict:
    raise APIError(400, f"tools[{i}]: tool type {tool.get('type')!r} is not supported here: only function tools "
                        "(hosted tools such as web or file search run on OpenAI's servers)", param=f"tools[{i}].type")


def structured_output(body: ResponsesRequest, plan: ToolPlan) -> StructuredOutputsParams | None:
    """text.format, or the tool plan's mask; both at once constrain one output twice: a 400."""
    fmt = body.text.format if body.text is not None else TextFormat()
    if plan.spec is not None and fmt.type != "text":
        raise APIError(400, f"text.format {fmt.type!r} cannot be combined with tool_choice {plan.mode!r}: both "
                            "would constrain the same output", param="text.format")
    if plan.spec is not None:
        return plan.spec
    try:
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError(400, "text.format: json_schema needs a schema", param="text.format.schema")
            return StructuredOutputsParams(json=fmt.schema_)
    except QuantkitError as exc:
        raise APIError(400, str(exc), param="text.format") from exc
    return None


def num_logprobs(body: ResponsesRequest, plan: ToolPlan) -> int | None:
    """How many alternatives come with each output token's logprob (OpenAI's way: include
    message.output_text.logprobs asks for the logprobs, top_logprobs for alternatives), or None when not asked.
    They are reported on output_text, so only where the output is text (tool_choice none or no tools)."""
    if LOGPROBS_INCLUDE not in (body.include or []):
        if body.top_logprobs:
            raise APIError(400, f"top_logprobs needs include [{LOGPROBS_INCLUDE!r}] (as OpenAI's API)",
                           param="top_logprobs")
        return None
    if plan.mode != "none":
        raise APIError(400, f"include {LOGPROBS_INCLUDE}: logprobs come on output text, so not with tool_choice "
                            f"{plan.mode!r} (the output may hold calls)", param="include")
    return body.top_logprobs or 0


def sampling_params(body: ResponsesRequest, max_tokens: int, spec: StructuredOutputsParams | None,
                    logprobs: int | None = None) -> SamplingParams:
    try:
        return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, max_tokens=max_tokens,
                              structured_outputs=spec, logprobs=logprobs)
    except QuantkitError as exc:
        raise APIError(400, str(exc)) from exc
