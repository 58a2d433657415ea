"""No field silently ignored: every request field of the official client's request types (and vLLM's extras) is in
quantkit.serve.fields as honoured or refused, and the live server answers a refused or unknown field with a 400 that
names it. The honoured ones that are new here: logit_bias, best_of, prompt_logprobs, seed, user."""

from __future__ import annotations

import logging
import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params

from quantkit.serve.embeddings import EmbeddingRequest
from quantkit.serve.errors import APIError
from quantkit.serve.fields import CHAT, COMPLETIONS, EMBEDDINGS, FIELDS, PATHS as ENDPOINT_PATHS, check_fields
from quantkit.serve.protocol import ChatCompletionRequest, CompletionRequest

CLIENT_TYPES = {CHAT: chat_create_params.CompletionCreateParamsBase,
                COMPLETIONS: completion_create_params.CompletionCreateParamsBase,
                EMBEDDINGS: embedding_create_params.EmbeddingCreateParams}
MODELS = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest, EMBEDDINGS: EmbeddingRequest}
PATHS = {CHAT: "chat/completions", COMPLETIONS: "completions"}


@pytest.mark.parametrize("endpoint", CLIENT_TYPES)
def test_every_field_of_the_official_client_is_honoured_or_refused(endpoint):
    """A new openai release with a new field fails here until the field is classified in quantkit.serve.fields."""
    fields = set(typing.get_type_hints(CLIENT_TYPES[endpoint])) | ({"stream"} if endpoint != EMBEDDINGS else set())
    assert not fields - set(FIELDS[endpoint]), "unclassified: add them to quantkit/serve/fields.py"


@pytest.mark.parametrize("endpoint", CLIENT_TYPES)
def test_the_honoured_fields_are_exactly_the_request_models_fields(endpoint):
    """What the table calls honoured the request model reads; what it refuses the model does not declare."""
    honoured = {name for name, f in FIELDS[endpoint].items() if f.honoured}
    declared = {f.alias or name for name, f in MODELS[endpoint].model_fields.items()}
    assert honoured == declared


REFUSED = [  # (endpoint, field, a value that asks for something this server does not do)
    (COMPLETIONS, "suffix", "!"), (CHAT, "functions", [{"name": "f", "parameters": {}}]),
    (CHAT, "function_call", "auto"), (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", ["text", "audio"]), (CHAT, "prediction", {"type": "content", "content": "x"}),
    (CHAT, "web_search_options", {}), (CHAT, "store", True), (CHAT, "service_tier", "flex"),
    (CHAT, "reasoning_effort", "high"), (CHAT, "metadata", {"a": "b"}), (COMPLETIONS, "use_beam_search", True),
    (COMPLETIONS, "truncate_prompt_tokens", 4), (CHAT, "no_such_field", 1), (CHAT, "best_of", 2),
    (COMPLETIONS, "tools", []), (COMPLETIONS, "n_predict", 3),
]
BODIES = {CHAT: {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          COMPLETIONS: {"model": "stories", "prompt": "Once", "max_tokens": 2}}


@pytest.mark.parametrize("endpoint,name,value", REFUSED)
def test_a_refused_or_unknown_field_is_a_400_naming_it(stories_server, endpoint, name, value):
    r = httpx.post(f"{stories_server.url}/v1/{PATHS[endpoint]}", json={**BODIES[endpoint], name: value}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and error["message"].startswith(name) and error["type"] == "invalid_request_error"
    spec = FIELDS[endpoint].get(name)
    assert spec is None or not spec.honoured


@pytest.mark.parametrize("endpoint", ENDPOINT_PATHS)
def test_one_check_serves_every_endpoint(endpoint):
    """Null asks for nothing and passes unknown; any other value of an unknown field is a 400 naming it and the
    endpoint, with the endpoint that honours it when there is one."""
    check_fields(endpoint, {"no_such_field": None})
    with pytest.raises(APIError) as unknown:
        check_fields(endpoint, {"no_such_field": 1})
    assert unknown.value.status == 400 and unknown.value.param == "no_such_field"
    assert unknown.value.message.startswith(f"no_such_field is not a field of {ENDPOINT_PATHS[endpoint]};")
    with pytest.raises(APIError, match=r"tools is not a field of /v1/completions \(it belongs to /v1/chat/completions\)"):
        check_fields(COMPLETIONS, {"tools": []})


def test_an_unknown_message_field_is_a_400_unless_null(tools_server):
    def post(message):
        return httpx.post(f"{tools_server.url}/v1/chat/completions", timeout=30, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}, message]})

    r = post({"role": "user", "content": "hi", "reasoning_content": "think"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].reasoning_content", r.text
    assert post({"role": "assistant", "content": "hi", "refusal": None, "audio": None}).status_code == 200


@pytest.mark.parametrize("name,value", [("store", False), ("modalities", ["text"]), ("service_tier", "auto"),
                                        ("audio", None), ("prompt_cache_key", "k"), ("user", "alice")])
def test_values_that_ask_for_nothing_more_pass(tools_server, name, value):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, name: value}
    r = httpx.post(f"{tools_server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


def token_ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def greedy(client, **kw):
    return client.completions.create(model="stories", prompt="Once upon a time", max_tokens=6, temperature=0,
                                     logprobs=0, extra_body={"return_tokens_as_token_ids": True, **kw}).choices[0]


def test_logit_bias_forces_and_forbids_tokens(client):
    base = token_ids(greedy(client))
    forced = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=6, temperature=0,
                                       logprobs=0, logit_bias={"300": 100},
                                       extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert token_ids(forced) == [300] * 6 != base
    banned = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=6, temperature=0,
                                       logprobs=0, logit_bias={str(base[0]): -100},
                                       extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert token_ids(banned)[0] != base[0]
    sampled = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=6, temperature=1.0,
                                        seed=1, logit_bias={"300": 100}, logprobs=0,
                                        extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert token_ids(sampled) == [300] * 6


@pytest.mark.parametrize("bias,words", [({"100000": 5}, "out of vocabulary"), ({"abc": 5}, "token ids"),
                                        ({"5": 500}, "[-100, 100]")])
def test_bad_logit_bias_is_a_400(client, bias, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client.completions.create(model="stories", prompt="Once", max_tokens=2, logit_bias=bias)


def test_best_of_returns_the_n_of_highest_cumulative_logprob(client):
    kw = dict(model="stories", prompt="Once upon a time", max_tokens=8, temperature=1.2, seed=21)
    all4 = client.completions.create(n=4, logprobs=0, **kw).choices
    ranked = sorted(all4, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 4 * 8  # all four were generated


@pytest.mark.parametrize("kw,words", [({"n": 3, "best_of": 2}, "at least n"),
                                      ({"best_of": 3, "stream": True}, "streamed")])
def test_best_of_that_cannot_be_served_is_a_400(client, kw, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client.completions.create(model="stories", prompt="Once", max_tokens=2, **kw)


def test_a_seed_reproduces_a_sampled_request(client):
    kw = dict(model="stories", prompt="Once upon a time", max_tokens=16, temperature=1.0)
    texts = [client.completions.create(seed=s, **kw).choices[0].text for s in (7, 7, 8)]
    assert texts[0] == texts[1] != texts[2]


def test_prompt_logprobs_score_every_prompt_token(client, tools_client):
    out = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=2,
                                    extra_body={"prompt_logprobs": 2})
    lps = out.choices[0].model_extra["prompt_logprobs"]  # vLLM's place on /v1/completions: the choice
    root = str(client.base_url).removesuffix("/v1/")
    ids = httpx.post(f"{root}/tokenize", json={"prompt": "Once upon a time"}).json()
    assert len(lps) == ids["count"] and lps[0] is None
    for token, entry in zip(ids["tokens"][1:], lps[1:]):
        assert str(token) in entry and len(entry) <= 3 and all(v["logprob"] <= 0 for v in entry.values())
    chat = tools_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_completion_tokens=2, extra_body={"prompt_logprobs": 1})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model="stories", prompt="Once", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})


def test_user_is_logged_with_the_request_id(client, caplog):
    with caplog.at_level(logging.INFO, logger="quantkit.serve"):
        client.completions.create(model="stories", prompt="Once", max_tokens=2, user="alice-42")
    assert any("cmpl-" in r.getMessage() and "alice-42" in r.getMessage() for r in caplog.records)
