"""/v1/completions through the official openai client against a real uvicorn server (stories260K)."""

from __future__ import annotations

import pytest

PROMPTS = ["Once upon a time", "The little dog", "Lily saw a big"]


@pytest.fixture(scope="module")
def offline(stories_server):
    """The offline engine's greedy tokens for PROMPTS (LLM.generate on the same checkpoint)."""
    from quantkit.engine import LLM, SamplingParams

    llm = LLM(stories_server.state.settings.engine.model, num_threads=1, dtype="float32")  # the server's dtype
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    return llm, outs


def test_greedy_completions_equal_offline_engine_tokens(client, offline):
    llm, outs = offline
    for prompt, ref in zip(PROMPTS, outs):
        r = client.completions.create(model="stories", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == ref.outputs[0].text
        assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_token_id_prompt_and_list_of_prompts(client, offline):
    llm, outs = offline
    r = client.completions.create(model="stories", prompt=outs[0].prompt_token_ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == outs[0].outputs[0].text
    r = client.completions.create(model="stories", prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in outs]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)


def test_stream_concatenation_equals_non_streamed_text(client):
    full = client.completions.create(model="stories", prompt=PROMPTS[0], max_tokens=30, temperature=0)
    chunks = list(client.completions.create(model="stories", prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_continuous_usage_stats_count_up(client):
    chunks = list(client.completions.create(model="stories", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 8


def test_stop_string_and_max_tokens_finish_reasons(client):
    ref = client.completions.create(model="stories", prompt=PROMPTS[0], max_tokens=24, temperature=0)
    text = ref.choices[0].text
    assert ref.choices[0].finish_reason == "length"
    stop = text[6:10]
    r = client.completions.create(model="stories", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]
    r = client.completions.create(model="stories", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == text[:text.index(stop) + len(stop)]


def test_echo_prepends_the_prompt(client):
    r = client.completions.create(model="stories", prompt=PROMPTS[2], max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPTS[2]) and len(r.choices[0].text) > len(PROMPTS[2])
    chunks = list(client.completions.create(model="stories", prompt=PROMPTS[2], max_tokens=5, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_unknown_fields_are_refused_by_name_and_model_is_optional(stories_server):
    import httpx

    r = httpx.post(f"{stories_server.url}/v1/completions",
                   json={"prompt": "Once", "max_tokens": 3, "temperature": 0, "no_such_field": [1, 2]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "no_such_field", r.text
    assert "no_such_field" in r.json()["error"]["message"]
    r = httpx.post(f"{stories_server.url}/v1/completions", json={"prompt": "Once", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "stories"
