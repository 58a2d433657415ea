"""/v1/responses against a real server with the official client: text, instructions, streamed events, structured
output held by the mask (stories260K knows nothing of JSON, so the mask makes it valid), a function-tool round trip,
and the fields this stateless server refuses, each by name."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from quantkit.serve.fields import FIELDS, RESPONSES
from tests_support.serving import serve_in_thread, settings_for

# A chat template that shows tools, tool calls and tool results, so the round trip reaches the prompt.
TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}"
            "</tool_call>{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Lily", "Tom", "Ben"]}, "happy": {"type": "boolean"},
                                           "age": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["name", "happy", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                          "required": ["city", "days"], "additionalProperties": False}}
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                "response.content_part.done", "response.output_item.done"]


def matches(value: dict, schema: dict) -> bool:
    """`value` against SCHEMA or WEATHER's parameters: the keys, the enums, the integer ranges, booleans."""
    props = schema["properties"]
    if sorted(value) != sorted(schema["required"]):
        return False
    for key, rule in props.items():
        v = value[key]
        if "enum" in rule and v not in rule["enum"]:
            return False
        if rule.get("type") == "integer" and not (isinstance(v, int) and rule["minimum"] <= v <= rule["maximum"]):
            return False
        if rule.get("type") == "boolean" and not isinstance(v, bool):
            return False
    return True


@pytest.fixture(scope="module")
def server(stories_dir):
    with serve_in_thread(settings_for(stories_dir, served_model_names=("stories",), chat_template=TEMPLATE)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def prompt_ids(server, messages: list[dict], tools=None) -> list[int]:
    tok = server.engine.tokenizer
    text = tok.apply_chat_template(messages, chat_template=TEMPLATE, tools=tools, tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def test_text_is_the_greedy_completion_of_the_rendered_prompt(server, client):
    r = client.responses.create(model="stories", input="Once upon a time", max_output_tokens=8, temperature=0,
                                metadata={"run": "a"})
    ids = prompt_ids(server, [{"role": "user", "content": "Once upon a time"}])
    same = client.completions.create(model="stories", prompt=ids, max_tokens=8, temperature=0)
    assert r.output_text == same.choices[0].text and r.output_text
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "stories"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (len(ids), 8, len(ids) + 8)
    assert r.metadata == {"run": "a"} and r.output[0].type == "message" and r.output[0].role == "assistant"


def test_instructions_are_a_system_message_as_developer_input_is(server, client):
    r = client.responses.create(model="stories", instructions="Be kind.", input="Tom", max_output_tokens=6,
                                temperature=0)
    ids = prompt_ids(server, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tom"}])
    assert r.usage.input_tokens == len(ids)
    same = client.completions.create(model="stories", prompt=ids, max_tokens=6, temperature=0)
    assert r.output_text == same.choices[0].text
    as_items = client.responses.create(model="stories", max_output_tokens=6, temperature=0, input=[
        {"role": "developer", "content": "Be kind."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tom"}]}])
    assert as_items.output_text == r.output_text and as_items.usage.input_tokens == len(ids)


def test_streamed_events_parse_in_order_and_add_up_to_the_response(client):
    kwargs = dict(model="stories", input="Lily", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]] == STREAM_ORDER + ["response.incomplete"]
    assert "".join(d.delta for d in deltas) == whole.output_text == events[-1].response.output_text
    assert all((len(d.delta) + len(d.obfuscation)) % 16 == 0 for d in deltas)  # include_obfuscation, on by default
    assert events[-1].response.usage.output_tokens == 10 and events[-1].response.status == "incomplete"
    plain = list(client.responses.create(stream=True, stream_options={"include_obfuscation": False}, **kwargs))
    assert all(getattr(e, "obfuscation", None) is None for e in plain if e.type == "response.output_text.delta")


def test_the_stream_helper_ends_with_response_completed(client):
    fmt = {"format": {"type": "json_schema", "name": "kid", "schema": SCHEMA, "strict": True}}
    with client.responses.stream(model="stories", input="A kid", text=fmt, max_output_tokens=60) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text and matches(json.loads(text), SCHEMA)


@pytest.mark.parametrize("fmt", [{"type": "json_schema", "name": "kid", "schema": SCHEMA, "strict": True},
                                 {"type": "json_object"}])
def test_text_format_json_is_held_by_the_mask(client, fmt):
    for _ in range(3):  # sampled at temperature 1: the model writes stories, the mask makes it JSON
        r = client.responses.create(model="stories", input="Once upon a time", text={"format": fmt},
                                    max_output_tokens=60, temperature=1.0)
        if fmt["type"] == "json_object":  # any object: a string in it may run to max_output_tokens
            assert r.output_text.startswith("{") and (r.status == "incomplete" or
                                                      isinstance(json.loads(r.output_text), dict)), r.output_text
        else:
            assert r.status == "completed" and matches(json.loads(r.output_text), SCHEMA), r.output_text
    free = client.responses.create(model="stories", input="Once upon a time", max_output_tokens=30, temperature=0)
    with pytest.raises(ValueError):  # the control: without the format it is a story
        json.loads(free.output_text)


def test_a_function_tool_round_trip(server, client):
    r = client.responses.create(model="stories", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=1.0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert matches(json.loads(calls[0].arguments), WEATHER["parameters"]) and calls[0].call_id
    user = {"role": "user", "content": "Weather in Paris?"}
    answer = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}
    follow = client.responses.create(model="stories", input=[user, *[c.model_dump() for c in calls], answer],
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=5, temperature=0)
    chat_tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    call = {"id": calls[0].call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.loads(calls[0].arguments)}}
    ids = prompt_ids(server, [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": calls[0].call_id, "name": "get_weather",
                               "content": "sunny, 21 C"}], tools=chat_tools)
    assert follow.usage.input_tokens == len(ids)  # the call and its result reached the prompt
    same = client.completions.create(model="stories", prompt=ids, max_tokens=5, temperature=0)
    assert follow.output_text == same.choices[0].text


def test_a_named_function_streams_its_call(client):
    events = list(client.responses.create(
        model="stories", input="Oslo", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60, temperature=1.0, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and matches(json.loads(done[0].arguments), WEATHER["parameters"])
    final = events[-1].response
    assert events[-1].type == "response.completed" and [i.type for i in final.output] == ["function_call"]
    assert final.output[0].arguments == done[0].arguments and final.output[0].status == "completed"


# A value that asks for something, for each field the server refuses (FIELDS[RESPONSES]' honoured=False).
REFUSED = {"previous_response_id": "resp_1",
           "conversation": "conv_1", "background": True, "background_options": {"x": 1},
           "prompt": {"id": "pmpt_1"}, "reasoning": {"effort": "high"}, "context_management": [{"type": "compaction"}],
           "prompt_cache_options": {"mode": "explicit"}, "moderation": {"model": "m"}, "image": {"detail": "low"},
           "access_programs": {"cyber": "standard"}}
# Honoured fields that take only some values, with one they refuse.
LIMITED = {"truncation": "auto", "service_tier": "priority", "prompt_cache_retention": "24h",
           "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
           "top_logprobs": 21}  # OpenAI's bound is 20


def test_every_client_field_is_classified():
    """A field a new openai release adds fails here until FIELDS says whether it is honoured or refused."""
    from openai.types.responses.response_create_params import ResponseCreateParamsBase

    assert set(ResponseCreateParamsBase.__annotations__) | {"stream"} == set(FIELDS[RESPONSES])
    assert set(REFUSED) == {name for name, rule in FIELDS[RESPONSES].items() if not rule.honoured}


@pytest.mark.parametrize("field,value", [*REFUSED.items(), *LIMITED.items(), ("temprature", 0.5)])
def test_a_refused_field_is_a_400_naming_it(server, field, value):
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "Hi", field: value}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [("background", False), ("reasoning", {"effort": None}), ("include", []),
                                         ("truncation", "disabled"), ("store", True), ("top_logprobs", 0)])
def test_a_value_that_asks_nothing_is_accepted(client, field, value):
    r = client.responses.create(model="stories", input="Hi", max_output_tokens=2, extra_body={field: value})
    assert r.usage.output_tokens == 2


@pytest.mark.parametrize("body,param", [
    ({"input": "Hi", "top_logprobs": 3}, "top_logprobs"),  # without include message.output_text.logprobs
    ({"input": "Hi", "include": ["message.output_text.logprobs"], "tools": [WEATHER], "tool_choice": "required"},
     "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "Hi", "tools": [WEATHER]}, "tool_choice"),  # auto, the default, without --enable-auto-tool-choice
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, None),
    ({"input": "Hi", "text": {"verbosity": "high"}}, "text.verbosity"),
    ({"input": "Hi", "max_output_tokens": 100000}, "max_output_tokens"),
])
def test_bad_requests_are_400s_in_openais_shape(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_logprobs_come_on_output_text_as_chat_reports_them(client):
    """include message.output_text.logprobs with top_logprobs: each output token's logprob and alternatives on the
    output_text part (and on each delta event, streamed), the same as the chat endpoint's for the same prompt."""
    include = ["message.output_text.logprobs"]
    r = client.responses.create(model="stories", input="Once", max_output_tokens=8, temperature=0, top_logprobs=3,
                                include=include)
    part = r.output[0].content[0]
    assert r.top_logprobs == 3 and len(part.logprobs) == r.usage.output_tokens == 8
    chat = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Once"}],
                                          max_completion_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    assert part.text == chat.choices[0].message.content
    expected = chat.choices[0].logprobs.content
    assert [lp.token for lp in part.logprobs] == [lp.token for lp in expected]
    assert [lp.bytes for lp in part.logprobs] == [lp.bytes for lp in expected]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    for got, want in zip(part.logprobs, expected):
        assert len(got.top_logprobs) == 3 and [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
        assert got.top_logprobs[0].logprob >= got.top_logprobs[-1].logprob and got.logprob <= 0

    events = list(client.responses.create(model="stories", input="Once", max_output_tokens=8, temperature=0,
                                          top_logprobs=3, include=include, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response.output[0].content[0]
    assert [lp.token for lp in streamed] == [lp.token for lp in done.logprobs] == [lp.token for lp in part.logprobs]
    assert [lp.logprob for lp in final.logprobs] == pytest.approx([lp.logprob for lp in part.logprobs], abs=1e-4)
    plain = client.responses.create(model="stories", input="Once", max_output_tokens=4, temperature=0)
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs is None  # not asked: none


def test_stored_responses_are_refused_as_the_server_is_stateless(client):
    with pytest.raises(openai.BadRequestError, match="stateless"):
        client.responses.retrieve("resp_123")
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="stories", input="Hi", previous_response_id="resp_123")


def _decoded(text: str, splits: int, plan_mode: str = "auto", max_calls: int | None = None) -> tuple[list, dict]:
    """The events and final response of an output fed to tool_choice's decoder in `splits` pieces."""
    from quantkit.serve.responses_in import ResponsesRequest, tool_request
    from quantkit.serve.responses_out import ResponseEvents, output_decoder, usage
    from quantkit.serve.tool_choice import plan_tools

    body = ResponsesRequest(input="x", tools=[WEATHER], tool_choice=plan_mode, max_tool_calls=max_calls)
    plan = plan_tools(tool_request(body), auto_enabled=True, parser="hermes")  # the route's own way to its plan
    assert plan.max_calls == max_calls
    events = ResponseEvents(body, "m", plan.max_calls)
    decoder = output_decoder(plan)
    out = events.start()
    step = -(-len(text) // splits)
    for i in range(0, len(text), step):
        out += events.pieces(decoder.feed(text[i:i + step]))
    out += events.pieces(decoder.finish()) + events.finish(usage(3, 4), None)
    return out, out[-1]["response"]


@pytest.mark.parametrize("choice", ["none", "auto", "required", {"type": "function", "name": "get_weather"}])
@pytest.mark.parametrize("parallel", [True, False])
def test_a_responses_request_gets_the_plan_of_the_same_chat_request(choice, parallel):
    """One planner, tool_choice.plan_tools, for both endpoints: the same tools and choice, the same plan."""
    from quantkit.serve.protocol import ChatCompletionRequest
    from quantkit.serve.responses_in import ResponsesRequest, tool_request
    from quantkit.serve.tool_choice import chat_tool_request, plan_tools

    function = {k: v for k, v in WEATHER.items() if k != "type"}
    chat_choice = {"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict) else choice
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tool_choice=chat_choice,
                                 tools=[{"type": "function", "function": function}], parallel_tool_calls=parallel)
    responses = ResponsesRequest(input="x", tools=[WEATHER], tool_choice=choice, parallel_tool_calls=parallel)
    plans = [plan_tools(r, auto_enabled=True, parser="hermes")
             for r in (chat_tool_request(chat), tool_request(responses))]
    assert plans[0] == plans[1] and plans[0].mode == (choice if isinstance(choice, str) else "named")


@pytest.mark.parametrize("splits", [1, 7, 200])
def test_auto_tool_choice_parses_calls_out_of_the_text_in_any_split(splits):
    """A random model never writes a call by itself, so tool_choice auto's parsing is checked on the output of a
    model that did (Hermes / Qwen format), fed whole and in pieces, through the response's real event machine."""
    text = ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>')
    events, response = _decoded(text, splits)
    items = response["output"]
    assert [i["type"] for i in items] == ["message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "Let me look. " and items[0]["status"] == "completed"
    assert [json.loads(i["arguments"]) for i in items[1:]] == [{"city": "Oslo", "days": 2}, {"city": "Paris", "days": 1}]
    assert len({i["call_id"] for i in items[1:]}) == 2 and response["status"] == "completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    one, _ = _decoded(text, splits, max_calls=1)  # parallel_tool_calls false
    assert len([e for e in one if e["type"] == "response.function_call_arguments.done"]) == 1


def test_parse_with_a_pydantic_model_validates(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Kid(BaseModel):
        name: Literal["Lily", "Tom", "Ben"]
        age: int = Field(ge=1, le=9)

    for _ in range(2):
        r = client.responses.parse(model="stories", input="A kid", text_format=Kid, max_output_tokens=40,
                                   temperature=1.0)
        assert isinstance(r.output_parsed, Kid), r.output_text


def test_a_stream_the_client_leaves_is_aborted(server):
    with server.paced(0.1):  # 300 steps would take 30 s: only an abort makes the engine idle within 10 s
        with httpx.stream("POST", f"{server.url}/v1/responses", timeout=30,
                          json={"input": "Once", "max_output_tokens": 300, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines) == "event: response.created"
        server.wait_idle(timeout=10)
