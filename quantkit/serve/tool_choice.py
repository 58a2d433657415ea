"""`tools` and `tool_choice` of a request (chat, or the Responses API's through responses_in.tool_request): what
constrains the output, and how the output becomes tool calls.

  none       the tools reach the chat template; the output is text
  auto       the model may call: its output is parsed by --tool-call-parser (needs --enable-auto-tool-choice, as vLLM)
  required   the output is held by a token mask to a JSON array of calls of the given tools (tool_calls.
             required_schema), so each call's arguments parse against its tool's schema
  named      the output is held to the named tool's parameters schema: it is that call's arguments

Streamed, a call goes out as OpenAI sends it: a delta with its index, id, type, name and empty arguments, then
deltas of argument fragments (under required and named, as they are generated; under auto, whole once parsed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from quantkit.engine.sampling_params import StructuredOutputsParams
from quantkit.serve.errors import APIError
from quantkit.serve.protocol import ChatCompletionRequest, NamedToolChoice
from quantkit.serve.tool_calls import (FORMATS, ToolCall, ToolCallFormat, ToolCallStream, calls_from_required,
                                       new_call_id, parse_tool_calls, required_schema)


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools, in the chat endpoint's shapes whichever endpoint it came by (chat_tool_request,
    responses_in.tool_request)."""

    tools: list[dict]  # OpenAI's chat tool objects ({"type": "function", "function": {...}})
    choice: str | None  # none, auto, required, named; None: OpenAI's default (auto with tools, none without)
    name: str | None = None  # named's function
    parallel: bool = True  # parallel_tool_calls
    max_calls: int | None = None  # max_tool_calls (the Responses API's)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none, auto, required, named
    tools: list[dict]  # OpenAI's tool objects, for the chat template ([] without tools)
    spec: StructuredOutputsParams | None = None  # the mask of required and named
    parser: ToolCallFormat | None = None  # auto's
    name: str | None = None  # named's tool
    parallel: bool = True
    max_calls: int | None = None  # at most this many calls are returned (1 with parallel_tool_calls false)


def require_auto_enabled(auto_enabled: bool, parser: str | None) -> None:
    """tool_choice "auto" parses free output for calls: the server must say in which format (vLLM's rule)."""
    if not auto_enabled or parser is None:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                       param="tool_choice")


def chat_tool_request(body: ChatCompletionRequest) -> ToolRequest:
    choice = body.tool_choice
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    if isinstance(choice, NamedToolChoice):
        return ToolRequest(tools, "named", choice.function.name, body.parallel_tool_calls)
    return ToolRequest(tools, choice, parallel=body.parallel_tool_calls)


def plan_tools(request: ToolRequest, auto_enabled: bool, parser: str | None) -> ToolPlan:
    """The request's plan (mode "none" without tools); a 400 for a choice that cannot be served."""
    choice, tools = request.choice, request.tools
    if choice not in (None, "none", "auto", "required") and not (choice == "named" and request.name is not None):
        raise APIError(400, f"tool_choice: {choice!r} is not one of none, auto, required", param="tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan("none", [])
    choice = "auto" if choice is None else choice  # OpenAI's default when tools are given
    max_calls = request.max_calls if request.parallel else 1
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        require_auto_enabled(auto_enabled, parser)
        return ToolPlan("auto", tools, parser=FORMATS[parser], parallel=request.parallel, max_calls=max_calls)
    if choice == "required":
        schema = required_schema(tools)
        if max_calls is not None:
            schema["maxItems"] = max_calls
        return ToolPlan("required", tools, StructuredOutputsParams(json=schema), parallel=request.parallel,
                        max_calls=max_calls)
    named = next((t["function"] for t in tools if t["function"]["name"] == request.name), None)
    if named is None:
        raise APIError(400, f"tool_choice names {request.name!r}, which is not among the tools", param="tool_choice")
    schema = named.get("parameters") or {"type": "object"}
    return ToolPlan("named", tools, StructuredOutputsParams(json=schema), name=request.name, parallel=False,
                    max_calls=max_calls)


def message_calls(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
    """A whole output -> (content, tool calls). A forced output cut short (finish_reason "length") does not parse:
    it stays content."""
    if plan.mode == "none":
        return text, []
    if plan.mode == "auto":
        parsed = parse_tool_calls(text, plan.parser)
        return parsed.content, parsed.tool_calls if plan.parallel else parsed.tool_calls[:1]
    if finish_reason == "length":
        return text, []
    if plan.mode == "named":
        return None, [ToolCall(new_call_id(), plan.name, text)]
    return None, calls_from_required(text)


@dataclass
class ToolDelta:
    """One piece of a streamed message: content, a call's start (index, id, name) or a fragment of its arguments."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def wire(self) -> dict:
        """The tool_calls entry of a chunk's delta, as OpenAI writes it."""
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments or ""}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


@dataclass
class RequiredCallsStream:
    """Streams an output written under required_schema (`[{"name": ..., "parameters": {...}}, ...]`, keys in that
    order, as the mask writes them): a call starts when its parameters object opens, whose text then goes out as
    it comes. `named`: the whole output is one call's arguments."""

    named: str | None = None
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _header: str = ""  # the current call's text before its parameters
    _in_args: bool = False
    _calls: int = 0

    def feed(self, text: str) -> list[ToolDelta]:
        if self.named is not None:
            out = [] if self._calls else [ToolDelta(index=0, id=new_call_id(), name=self.named, arguments="")]
            self._calls = 1
            return out + ([ToolDelta(index=0, arguments=text)] if text else [])
        out: list[ToolDelta] = []
        fragment = []
        for ch in text:
            opened = self._step(ch)
            if opened:  # the parameters object opens: the call starts
                match = _NAME.search(self._header)
                out.append(ToolDelta(index=self._calls, id=new_call_id(),
                                     name=json.loads(match.group(1)) if match else "", arguments=""))
                self._in_args, self._header = True, ""
            if self._in_args:
                fragment.append(ch)
                if self._depth == 2 and ch == "}" and not self._in_string:  # the parameters object closed
                    out.append(ToolDelta(index=self._calls, arguments="".join(fragment)))
                    fragment, self._in_args = [], False
                    self._calls += 1
            elif self._depth >= 2:
                self._header += ch
        if fragment:
            out.append(ToolDelta(index=self._calls, arguments="".join(fragment)))
        return out

    def _step(self, ch: str) -> bool:
        """Track JSON nesting; True when `ch` opens an object at depth 3 (a call's parameters)."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
            return False
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
            if ch == "{" and self._depth == 2:  # a call opens
                self._header = ""
            return ch == "{" and self._depth == 3 and not self._in_args
        elif ch in "}]":
            self._depth -= 1
        return False

    def finish(self) -> list[ToolDelta]:
        return []

    @property
    def num_calls(self) -> int:
        return self._calls


@dataclass
class AutoCallsStream:
    """Streams an output under tool_choice auto through --tool-call-parser: content as it comes, each call whole."""

    parser: ToolCallFormat
    parallel: bool = True
    _stream: ToolCallStream = field(init=False)

    def __post_init__(self):
        self._stream = ToolCallStream(self.parser)

    def feed(self, text: str) -> list[ToolDelta]:
        return self._convert(self._stream.feed(text))

    def finish(self) -> list[ToolDelta]:
        return self._convert(self._stream.finish())

    def _convert(self, events) -> list[ToolDelta]:
        out = []
        for e in events:
            if e.content is not None:
                out.append(ToolDelta(content=e.content))
            elif self.parallel or e.index == 0:
                out += [ToolDelta(index=e.index, id=e.call.id, name=e.call.name, arguments=""),
                        ToolDelta(index=e.index, arguments=e.call.arguments)]
        return out

    @property
    def num_calls(self) -> int:
        return self._stream.num_calls if self.parallel else min(1, self._stream.num_calls)


def calls_stream(plan: ToolPlan):
    """A stream parser for one choice's output under `plan`, or None when the output is plain text."""
    if plan.mode == "auto":
        return AutoCallsStream(plan.parser, plan.parallel)
    if plan.mode in ("required", "named"):
        return RequiredCallsStream(named=plan.name)
    return None
