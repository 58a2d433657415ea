"""The /v1/responses response object and its stream events, as OpenAI writes them.

One state machine (`ResponseEvents`) builds both: the output is a sequence of pieces (text, function calls) from
an `OutputDecoder`; each piece opens, extends or closes an output item and yields the events OpenAI streams for it:

  response.created, response.in_progress
  per message:  response.output_item.added, response.content_part.added, response.output_text.delta ...,
                response.output_text.done, response.content_part.done, response.output_item.done
  per call:     response.output_item.added, response.function_call_arguments.delta, ...arguments.done,
                response.output_item.done
  response.completed (or response.incomplete when max_output_tokens cut it)

Every event carries a `sequence_number` from 0. A non-streaming request runs the same machine and returns the final
response object; so the streamed and the whole response cannot disagree.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from quantkit.serve.responses_in import ResponsesRequest
from quantkit.serve.tool_calls import StreamEvent, ToolCall, ToolCallStream, calls_from_required, new_call_id
from quantkit.serve.tool_choice import ToolPlan

_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
OBFUSCATION_BLOCK = 16  # delta events are padded to a multiple of this many characters (stream_options)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def sse_event(event: dict) -> str:
    """OpenAI names each event on its own `event:` line, and sends no [DONE]."""
    return f"event: {event['type']}\ndata: {_COMPACT.encode(event)}\n\n"


class OutputDecoder:
    """Model output -> pieces (StreamEvents: content text, or a call) as it streams. This one: all text."""

    def feed(self, delta: str) -> list[StreamEvent]:
        return [StreamEvent(content=delta)] if delta else []

    def finish(self) -> list[StreamEvent]:
        return []


class _HeldCalls(OutputDecoder):
    """An output the mask holds to calls (tool_choice required or named): whole once it ends; text if cut off."""

    def __init__(self, named: str | None):
        self.named, self.text = named, ""

    def feed(self, delta: str) -> list[StreamEvent]:
        self.text += delta
        return []

    def finish(self) -> list[StreamEvent]:
        try:
            calls = (calls_from_required(self.text) if self.named is None
                     else [ToolCall(new_call_id(), self.named, json.dumps(json.loads(self.text), ensure_ascii=False))])
        except ValueError:  # cut off by max_output_tokens: not JSON yet
            return [StreamEvent(content=self.text)] if self.text else []
        return [StreamEvent(index=i, call=c) for i, c in enumerate(calls)]


def output_decoder(plan: ToolPlan) -> OutputDecoder | ToolCallStream:
    if plan.mode == "auto":
        return ToolCallStream(plan.parser)
    if plan.mode in ("required", "named"):
        return _HeldCalls(plan.name)
    return OutputDecoder()


@dataclass
class ResponseEvents:
    body: ResponsesRequest
    model: str
    max_calls: int | None = None
    obfuscate: bool = False
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict] = field(default_factory=list)  # the items so far (the open one last)
    _seq: int = 0
    _message: dict | None = None  # the open message item
    _calls: int = 0
    _logprobs: list[dict] = field(default_factory=list)  # output tokens' logprobs not yet on a text delta

    def response(self, status: str, usage_: dict | None = None, incomplete: str | None = None,
                 error: dict | None = None) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "max_tool_calls":
                b.max_tool_calls, "metadata": b.metadata or {}, "model": self.model, "output": self.output,
                "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": None, "reasoning": None,
                "service_tier": "default", "store": b.store,
                "temperature": 1.0 if b.temperature is None else b.temperature,
                "text": b.text.model_dump(by_alias=True, exclude_none=True) if b.text else {"format": {"type": "text"}},
                "tool_choice": b.tool_choice, "tools": b.tools, "top_logprobs": b.top_logprobs,
                "top_p": 1.0 if b.top_p is None else b.top_p,
                "truncation": "disabled", "usage": usage_, "user": b.user}

    def _event(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def logprobs(self, entries: list[dict]) -> None:
        """Output tokens' logprobs (chat's entries: token, logprob, bytes, top_logprobs), for the next text delta
        (a token may add no text yet: a byte of a character)."""
        self._logprobs += entries

    def pieces(self, events: list[StreamEvent]) -> list[dict]:
        out: list[dict] = []
        for e in events:
            out += self.text(e.content) if e.call is None else self.call(e.call)
        return out

    def text(self, delta: str) -> list[dict]:
        events = [] if self._message is not None else self._open_message()
        logprobs, self._logprobs = self._logprobs, []
        part = self._message["content"][0]
        part["text"] += delta
        part["logprobs"] += logprobs
        return events + [self._event("response.output_text.delta", item_id=self._message["id"],
                                     output_index=len(self.output) - 1, content_index=0, delta=delta,
                                     logprobs=logprobs, **self._padding(delta))]

    def call(self, call: ToolCall) -> list[dict]:
        if self.max_calls is not None and self._calls >= self.max_calls:
            return []  # past max_tool_calls (or a second call with parallel_tool_calls false)
        self._calls += 1
        events = self._close_message("completed")
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                "call_id": call.id, "name": call.name}
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=call.arguments, **self._padding(call.arguments)))
        item.update(arguments=call.arguments, status="completed")
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=call.arguments))
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def finish(self, usage_: dict, incomplete: str | None) -> list[dict]:
        """Close what is open; the last event carries the whole response (response.completed or .incomplete)."""
        events = self._open_message() if not self.output else []  # OpenAI always answers with an item
        events += self._close_message("incomplete" if incomplete else "completed")
        status = "incomplete" if incomplete else "completed"
        return events + [self._event(f"response.{status}", response=self.response(status, usage_, incomplete))]

    def fail(self, message: str) -> list[dict]:
        error = {"code": "server_error", "message": message}
        return [self._event("error", code="server_error", message=message, param=None),
                self._event("response.failed", response=self.response("failed", error=error))]

    def _open_message(self) -> list[dict]:
        self._message = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                         "content": []}
        self.output.append(self._message)
        index = len(self.output) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = [self._event("response.output_item.added", output_index=index, item=json.loads(json.dumps(
            self._message))),
                  self._event("response.content_part.added", item_id=self._message["id"], output_index=index,
                              content_index=0, part=dict(part))]
        self._message["content"].append(part)
        return events

    def _close_message(self, status: str) -> list[dict]:
        message, self._message = self._message, None
        if message is None:
            return []
        index, part = self.output.index(message), message["content"][0]
        part["logprobs"] += self._logprobs  # tokens that added no text
        message["status"], self._logprobs = status, []
        common = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **common, text=part["text"], logprobs=part["logprobs"]),
                self._event("response.content_part.done", **common, part=part),
                self._event("response.output_item.done", output_index=index, item=message)]

    def _padding(self, delta: str) -> dict:
        """stream_options.include_obfuscation (on by default, as OpenAI's): random characters that bring a delta
        event's text to a multiple of OBFUSCATION_BLOCK, so that its size does not give away the token's length."""
        if not self.obfuscate:
            return {}
        return {"obfuscation": uuid.uuid4().hex[:OBFUSCATION_BLOCK - len(delta) % OBFUSCATION_BLOCK]}
