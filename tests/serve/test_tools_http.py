"""Tool calling over HTTP with the official client, on a random tiny Llama: tool_choice "required" and a named tool
give calls whose arguments validate against the tool's schema (the mask holds them to it), streamed as OpenAI streams
them; a round trip feeds the call and the tool's answer back through the chat template; "auto" needs vLLM's flags."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field


class GetWeather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=7)


class GetTime(BaseModel):
    model_config = ConfigDict(extra="forbid")
    zone: str = Field(pattern="^(UTC|CET|PST)$")


TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
MODELS = {"GetWeather": GetWeather, "GetTime": GetTime}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "GetTime"}}


def check_calls(calls, only: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert only is None or call.function.name == only
        MODELS[call.function.name].model_validate_json(call.function.arguments)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_validate_against_their_tools(tools_client, choice):
    out = tools_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, n=3, temperature=1.0,
                                               seed=5, max_completion_tokens=150,
                                               tool_choice="required" if choice == "required" else NAMED)
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        check_calls(c.message.tool_calls, None if choice == "required" else "GetTime")


def test_parse_validates_the_arguments_with_the_tools_models(tools_client):
    out = tools_client.chat.completions.parse(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_completion_tokens=150)
    for call in out.choices[0].message.tool_calls:
        assert isinstance(call.function.parsed_arguments, MODELS[call.function.name])


def test_parallel_tool_calls_false_gives_one_call(tools_client):
    out = tools_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, n=4, temperature=1.0, seed=9,
                                               max_completion_tokens=150)
    assert all(len(c.message.tool_calls) == 1 for c in out.choices)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_calls_come_as_openai_sends_them(tools_client, choice):
    """First a delta with index, id, type and name (empty arguments), then argument fragments; assembled, the same
    calls as the whole response gives for the same seed."""
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=11, max_completion_tokens=150,
              tool_choice="required" if choice == "required" else NAMED)
    whole = tools_client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish, fragments = None, 0
    for chunk in tools_client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for tc in delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls and tc.type == "function" and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.function.name is None and tc.index in calls
                calls[tc.index]["arguments"] += tc.function.arguments
                fragments += 1
        assert not delta.content
    assert finish == "tool_calls" and fragments > len(calls)  # arguments come in pieces
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    for c in calls.values():
        MODELS[c["name"]].model_validate_json(c["arguments"])


def test_a_round_trip_feeds_the_call_and_the_answer_back(tools_client, tools_server):
    first = tools_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                                 temperature=0, max_completion_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    rendered = httpx.post(f"{tools_server.url}/tokenize", json={"model": "tiny", "messages": messages}).json()
    with_tools = httpx.post(f"{tools_server.url}/tokenize",
                            json={"model": "tiny", "messages": messages, "tools": TOOLS}).json()
    again = tools_client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                                 temperature=0, max_completion_tokens=10)
    assert again.choices[0].message.tool_calls is None and again.choices[0].finish_reason in ("stop", "length")
    assert again.usage.prompt_tokens == with_tools["count"] > rendered["count"]  # the tools went into the template
    text = tools_server.state.tokenizer.decode(rendered["tokens"])
    assert "12:00" in text and "GetTime" in text and json.loads(call.function.arguments)["zone"] in text


def test_auto_parses_what_the_model_writes_and_leaves_text_alone(tools_client):
    out = tools_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0,
                                               max_completion_tokens=10)  # auto: the default with tools
    plain = tools_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                                 temperature=0, max_completion_tokens=10)
    assert out.choices[0].message.tool_calls is None  # a random model writes no <tool_call> block
    assert out.choices[0].message.content == plain.choices[0].message.content


def test_auto_without_the_flags_is_a_400_as_vllm(client):
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model="stories", messages=MESSAGES, tools=TOOLS, max_completion_tokens=5)


@pytest.mark.parametrize("kw,words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
])
def test_tool_requests_that_cannot_be_served_are_400s(tools_client, kw, words):
    with pytest.raises(openai.BadRequestError, match=words):
        tools_client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                                                "max_completion_tokens": 5, **kw})
