"""/v1/chat/completions: a tiny model saved with a chat template renders through apply_chat_template."""

from __future__ import annotations

import httpx
import pytest

from tests_support.serving import serve_in_thread, settings_for

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests_support.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-chat"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_server(chat_model):
    with serve_in_thread(settings_for(chat_model, served_model_names=("tiny-chat",))) as srv:
        yield srv


def test_chat_renders_the_template_and_matches_a_completion(chat_server):
    import openai

    client = openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12, temperature=0)
    tok = chat_server.engine.tokenizer
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>")
    ids = tok(rendered, add_special_tokens=False).input_ids
    assert r.usage.prompt_tokens == len(ids)
    same = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == same.choices[0].text
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    tokenized = httpx.post(f"{chat_server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert tokenized["tokens"] == ids


def test_chat_stream_opens_with_the_role_and_ends_with_done(chat_server):
    with httpx.stream("POST", f"{chat_server.url}/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    import json

    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = [c for c in chunks[1:] if c["choices"]]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_chat_template_flag_overrides(stories_dir, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    from quantkit.serve.settings import read_chat_template

    with serve_in_thread(settings_for(stories_dir, chat_template=read_chat_template(template))) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                       json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
