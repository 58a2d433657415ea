"""Tool calls parsed from a model's output (quantkit.serve.tool_calls), whole and streamed in every split, against
the calls written into it."""

from __future__ import annotations

import json

import pytest

from quantkit.serve.tool_calls import (FORMATS, ParsedMessage, ToolCallStream, calls_from_required, parse_tool_calls,
                                       required_schema)

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "UTC"}

CASES = {  # format -> (output, content, [(name, arguments)])
    "hermes": ('I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
               '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
               "I will check.", [("get_weather", WEATHER), ("get_time", TIME)]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"zone": "UTC"}}', None,
                    [("get_weather", WEATHER), ("get_time", TIME)]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}]', None,
                [("get_weather", WEATHER), ("get_time", TIME)]),
}


def calls_of(parsed: ParsedMessage):
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.mark.parametrize("name", CASES)
def test_whole_outputs_give_their_content_and_calls(name):
    text, content, calls = CASES[name]
    parsed = parse_tool_calls(text, FORMATS[name])
    assert parsed.content == content and calls_of(parsed) == calls
    assert len({c.id for c in parsed.tool_calls}) == len(calls) and all(c.id.startswith("chatcmpl-tool-")
                                                                       for c in parsed.tool_calls)


def test_a_bare_llama3_call_and_plain_text():
    fmt = FORMATS["llama3_json"]
    parsed = parse_tool_calls('{"name": "get_time", "parameters": {"zone": "UTC"}}', fmt)
    assert parsed.content is None and calls_of(parsed) == [("get_time", TIME)]
    assert parse_tool_calls("It is sunny, {no call here}.", fmt) == ParsedMessage("It is sunny, {no call here}.", [])


@pytest.mark.parametrize("text", ["<tool_call>{not json}</tool_call> and more", "<tool_call>{\"x\": 1}</tool_call>",
                                  "talking about <tool_call> tags without closing one"])
def test_a_block_that_is_not_a_call_stays_content(text):
    assert parse_tool_calls(text, FORMATS["hermes"]) == ParsedMessage(text, [])


def stream(text: str, name: str, cuts: list[int]):
    s = ToolCallStream(FORMATS[name])
    events, last = [], 0
    for cut in cuts + [len(text)]:
        events += s.feed(text[last:cut])
        last = cut
    events += s.finish()
    content = "".join(e.content for e in events if e.content is not None)
    return content, [(e.call.name, json.loads(e.call.arguments)) for e in events if e.call is not None], events


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streams_in_any_split_give_the_same_content_and_calls(name, step):
    text, content, calls = CASES[name]
    got_content, got_calls, events = stream(text, name, list(range(step, len(text), step)))
    assert got_content == (content or "") and got_calls == calls
    assert [e.index for e in events if e.call is not None] == list(range(len(calls)))


def test_a_stream_holds_back_only_what_may_be_a_marker():
    s = ToolCallStream(FORMATS["hermes"])
    assert [e.content for e in s.feed("Hello <tool")] == ["Hello "]  # "<tool" may open a call
    assert [e.content for e in s.feed("box> world")] == ["<toolbox> world"]
    assert s.finish() == []


def test_required_schema_and_its_calls():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    schema = required_schema(tools)
    assert schema["minItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    calls = calls_from_required('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


REQUIRED_TEXT = ('[{"name": "get_weather", "parameters": {"city": "Pa}ri\\"s", "unit": "celsius"}}, '
                 '{"name": "get_time", "parameters": {"zone": "UTC"}}]')


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_a_required_output_streams_calls_then_fragments_in_any_split(step):
    from quantkit.serve.tool_choice import RequiredCallsStream

    s, deltas = RequiredCallsStream(), []
    for i in range(0, len(REQUIRED_TEXT), step):
        deltas += s.feed(REQUIRED_TEXT[i:i + step])
    calls: dict[int, list] = {}
    for d in deltas:
        assert d.content is None
        if d.id is not None:
            assert d.index not in calls and d.arguments == ""
            calls[d.index] = [d.name, ""]
        else:
            calls[d.index][1] += d.arguments
    assert [(n, json.loads(a)) for n, a in calls.values()] == [(c.name, json.loads(c.arguments))
                                                              for c in calls_from_required(REQUIRED_TEXT)]
    assert s.num_calls == 2


def test_chunk_deltas_put_a_calls_start_apart_from_its_fragments():
    from quantkit.serve.responses import tool_call_pieces
    from quantkit.serve.tool_choice import ToolDelta

    pieces = tool_call_pieces([ToolDelta(content="Hi"), ToolDelta(index=0, id="c0", name="f", arguments=""),
                               ToolDelta(index=0, arguments='{"a": '), ToolDelta(index=0, arguments="1}"),
                               ToolDelta(index=1, id="c1", name="g", arguments="")])
    assert pieces == [{"content": "Hi"},
                      {"tool_calls": [{"index": 0, "id": "c0", "type": "function",
                                       "function": {"name": "f", "arguments": ""}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
                      {"tool_calls": [{"index": 1, "id": "c1", "type": "function",
                                       "function": {"name": "g", "arguments": ""}}]}]
