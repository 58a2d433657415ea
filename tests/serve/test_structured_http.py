"""Structured outputs over HTTP, with the official client, on a random tiny Llama: the mask, not the model, makes every
output valid (the control: the same requests unconstrained are not). Every name clients use (OpenAI's response_format,
vLLM's structured_outputs and guided_*, llama-server's json_schema and grammar), streamed and with n = 3; two names at
once, or a spec that does not compile, is a 400 that says so."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MESSAGES = [{"role": "user", "content": "Describe a person."}]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties false: a random model would add keys forever
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    kind: str = Field(pattern="^(cat|dog)$")


REGEX = r"[a-z]{2,5}-[0-9]{3}"
GBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'


def test_parse_with_a_pydantic_model_gives_objects_that_validate(tools_client):
    out = tools_client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Person, n=3,
                                              temperature=1.0, seed=1, max_completion_tokens=80)
    assert len(out.choices) == 3
    for c in out.choices:
        assert c.finish_reason == "stop" and isinstance(c.message.parsed, Person), c.message.content
    free = tools_client.chat.completions.create(model="tiny", messages=MESSAGES, n=3, temperature=1.0, seed=1,
                                                max_completion_tokens=40)
    for c in free.choices:  # the control: unconstrained, the random model writes no Person
        with pytest.raises(ValidationError):
            Person.model_validate_json(c.message.content)


def is_object(text: str) -> bool:
    """Any JSON object: complete, or (cut at max_tokens, since its keys are free) a prefix of one."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return text.startswith("{") and len(text) > 1


def stream_texts(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
    return texts


SPECS = {  # name -> (the request's extra fields, a check of one output)
    "response_format json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": Person.model_json_schema(), "strict": True}}},
        lambda t: Person.model_validate_json(t)),
    "response_format json_object": ({"response_format": {"type": "json_object"}}, lambda t: is_object(t)),
    "structured_outputs regex": ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    "structured_outputs choice": ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
                                  lambda t: t in ("red", "green", "blue")),
    "structured_outputs grammar": ({"structured_outputs": {"grammar": GBNF}},
                                   lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
    "structured_outputs json": ({"structured_outputs": {"json": Person.model_json_schema()}},
                                lambda t: Person.model_validate_json(t)),
    "guided_json": ({"guided_json": Person.model_json_schema()}, lambda t: Person.model_validate_json(t)),
    "guided_regex": ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    "guided_choice": ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    "guided_grammar": ({"guided_grammar": GBNF}, lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
    "json_schema (llama-server)": ({"json_schema": Person.model_json_schema()},
                                   lambda t: Person.model_validate_json(t)),
    "grammar (llama-server)": ({"grammar": GBNF}, lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
}


def check_all(texts, check, name):
    for t in texts:
        assert check(t), (name, t)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("stream", [False, True])
def test_every_name_holds_chat_outputs_streamed_or_not(tools_client, name, stream):
    extra, check = SPECS[name]
    kw = dict(model="tiny", messages=MESSAGES, n=3, temperature=1.0, seed=2, max_completion_tokens=120,
              extra_body=extra)
    if stream:
        texts = list(stream_texts(tools_client.chat.completions.create(stream=True, **kw)).values())
    else:
        texts = [c.message.content for c in tools_client.chat.completions.create(**kw).choices]
    assert len(texts) == 3
    check_all(texts, check, name)


@pytest.mark.parametrize("name", ["structured_outputs regex", "guided_choice", "json_schema (llama-server)",
                                  "response_format json_schema"])
@pytest.mark.parametrize("stream", [False, True])
def test_completions_too(tools_client, name, stream):
    extra, check = SPECS[name]
    kw = dict(model="tiny", prompt="Once upon a time", n=3, temperature=1.0, seed=4, max_tokens=120,
              extra_body=extra)
    if stream:
        texts = list(stream_texts(tools_client.completions.create(stream=True, **kw)).values())
    else:
        texts = [c.text for c in tools_client.completions.create(**kw).choices]
    assert len(texts) == 3
    check_all(texts, check, name)


def test_response_format_text_asks_for_nothing(tools_client):
    out = tools_client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_completion_tokens=8,
                                               response_format={"type": "text"})
    plain = tools_client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                                 max_completion_tokens=8)
    assert out.choices[0].message.content == plain.choices[0].message.content


def error_of(exc: pytest.ExceptionInfo) -> dict:
    return exc.value.response.json()["error"]


def test_two_at_once_is_a_400_naming_both(tools_client):
    with pytest.raises(openai.BadRequestError) as exc:
        tools_client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=8,
                                             response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})
    assert "response_format" in error_of(exc)["message"] and "guided_regex" in error_of(exc)["message"]


@pytest.mark.parametrize("extra,words", [
    ({"guided_regex": "[a-z"}, "regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "json"),
    ({"structured_outputs": {"jsonn": {}}}, "jsonn"),
    ({"guided_choice": []}, "choice"),
])
def test_a_spec_that_does_not_compile_is_a_400_naming_the_problem(tools_server, extra, words):
    for path, body in (("chat/completions", {"messages": MESSAGES}), ("completions", {"prompt": "Once"})):
        r = httpx.post(f"{tools_server.url}/v1/{path}", json={**body, "max_tokens": 8, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"], r.text
    tools_server.wait_idle()
