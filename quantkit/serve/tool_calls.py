"""Tool calls in a chat model's output: the formats models write them in, parsed whole or as a stream, and the JSON
schemas that hold `tool_choice="required"` or a named function to arguments that parse.

Formats, as data (`FORMATS`; vLLM's `--tool-call-parser` names):
  hermes       Hermes, Qwen 2.5 and 3:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call
  llama3_json  Llama 3.1 / 3.2:         {"name": ..., "parameters": {...}}, after an optional <|python_tag|>; calls
                                        separated by ";"
  mistral      Mistral:                 [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
Text before the first call is the message's content; a block that does not parse as a call stays content, so a model
that merely talks about tools is never turned into a broken call.

Streaming (`ToolCallStream`): content passes through as it comes, except a tail that could still be the start of a
call marker, which is held back; a call goes out when its block closes (for llama3_json, whose calls have no end
marker, at the end of the output) as OpenAI streams one: a delta with its id, type and name and empty arguments,
then a delta with the arguments.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI's `function.arguments`


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # None when the message is tool calls only
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def call_from_object(obj, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A ToolCall from a decoded {"name": str, "arguments" | "parameters": object | JSON text}, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _json_calls(text: str, separator: str | None = None) -> list[ToolCall] | None:
    """The calls in a block: one JSON object, a JSON array of them, or objects joined by `separator`; None if any
    part is not a call."""
    parts = [text] if separator is None else [p for p in text.split(separator) if p.strip()]
    calls: list[ToolCall] = []
    for part in parts:
        try:
            value = json.loads(part)
        except ValueError:
            return None
        for obj in value if isinstance(value, list) else [value]:
            call = call_from_object(obj)
            if call is None:
                return None
            calls.append(call)
    return calls or None


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str  # what opens a call block
    end: str | None  # what closes it (None: the block runs to the end of the output)
    decode: Callable[[str], list[ToolCall] | None]  # a block's text -> its calls
    starts_bare: bool = False  # the output may open with the block's JSON itself, no marker (llama3_json)


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>", _json_calls),
    "llama3_json": ToolCallFormat("llama3_json", "<|python_tag|>", None, lambda t: _json_calls(t, ";"),
                                  starts_bare=True),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", None, _json_calls),
}


def parse_tool_calls(text: str, fmt: ToolCallFormat) -> ParsedMessage:
    """The content and calls of a whole output."""
    content, calls, rest = [], [], text
    if fmt.starts_bare and rest.lstrip().startswith("{"):
        rest = fmt.start + rest.lstrip()
    while (i := rest.find(fmt.start)) >= 0:
        content.append(rest[:i])
        body_start = i + len(fmt.start)
        j = rest.find(fmt.end, body_start) if fmt.end else -1
        body = rest[body_start:j] if j >= 0 else rest[body_start:]
        found = fmt.decode(body.strip())
        if found is None:  # not a call: the block stays text
            content.append(rest[i:j + len(fmt.end)] if j >= 0 else rest[i:])
        else:
            calls += found
        rest = rest[j + len(fmt.end):] if j >= 0 else ""
    content.append(rest)
    text_out = "".join(content)
    return ParsedMessage(text_out if text_out.strip() or not calls else None, calls)


@dataclass
class StreamEvent:
    """One piece of a streamed message: content text, or a call (its first delta: `index`, `call`)."""

    content: str | None = None
    index: int | None = None
    call: ToolCall | None = None


@dataclass
class ToolCallStream:
    """Parses an output as it is generated: `feed(delta)` and, at the end, `finish()` give StreamEvents."""

    fmt: ToolCallFormat
    _buffer: str = ""
    _opening: str | None = None  # inside a block: the marker that opened it ("" for a bare JSON call)
    _calls: int = 0
    _started: bool = False  # any text seen: a bare llama3_json call can only open the output

    def feed(self, delta: str) -> list[StreamEvent]:
        self._buffer += delta
        events: list[StreamEvent] = []
        while True:
            if self._opening is not None:  # inside a block: wait for its end
                if self.fmt.end is None or (j := self._buffer.find(self.fmt.end)) < 0:
                    return events
                self._close_block(self._buffer[:j], self._opening + self._buffer[:j + len(self.fmt.end)], events)
                self._buffer = self._buffer[j + len(self.fmt.end):]
                continue
            if not self._started and self.fmt.starts_bare:
                if not self._buffer.strip():
                    return events
                if self._buffer.lstrip().startswith("{"):
                    self._started, self._opening, self._buffer = True, "", self._buffer.lstrip()
                    continue
            self._started = self._started or bool(self._buffer.strip())
            i = self._buffer.find(self.fmt.start)
            if i >= 0:
                self._content(self._buffer[:i], events)
                self._opening, self._buffer = self.fmt.start, self._buffer[i + len(self.fmt.start):]
                continue
            keep = _marker_prefix_len(self._buffer, self.fmt.start)  # may be the start of a marker: hold it
            self._content(self._buffer[:len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return events

    def finish(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._opening is None:
            self._content(self._buffer, events)
        elif self.fmt.end is None:  # a block that runs to the end of the output
            self._close_block(self._buffer, self._opening + self._buffer, events)
        else:  # cut off before its end marker: text after all
            self._content(self._opening + self._buffer, events)
        self._buffer, self._opening = "", None
        return events

    @property
    def num_calls(self) -> int:
        return self._calls

    def _close_block(self, body: str, raw: str, events: list[StreamEvent]) -> None:
        found = self.fmt.decode(body.strip())
        if found is None:  # not a call: it was text after all
            self._content(raw, events)
        else:
            for call in found:
                events.append(StreamEvent(index=self._calls, call=call))
                self._calls += 1
        self._opening = None

    @staticmethod
    def _content(text: str, events: list[StreamEvent]) -> None:
        if text:
            events.append(StreamEvent(content=text))


def _marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def required_schema(tools: list[dict]) -> dict:
    """tool_choice="required": a JSON array of at least one call, each a {"name", "parameters"} of one of `tools`
    (OpenAI function tools), the arguments held to that function's schema."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                          "parameters": t["function"].get("parameters") or {"type": "object"}},
         "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}}


def calls_from_required(text: str) -> list[ToolCall]:
    """The calls in an output written under required_schema."""
    return [ToolCall(new_call_id(), c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in json.loads(text)]
