"""Logprobs on the wire as vLLM 0.32 writes them, on stories260K with a Metaspace tokenizer (as Llama 2's and
Mistral's tokenizer.json are): token texts keep their leading space, byte-fallback pieces never show as U+FFFD,
and text_offset runs over the tokens reported, from 0 at the echoed prompt's BOS ("<s>", counted as vLLM counts
it) through the completion, streamed or not. tests/interop/test_logprobs_vs_vllm.py compares the same requests
with vLLM's own server, byte for byte (by hand: it needs the vLLM venv)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests_support.live_server import CHAT_TEMPLATE
from tests_support.serving import serve_in_thread, settings_for
from tests_support.tiny_models import with_metaspace_tokenizer

PROMPT = "Once upon a time, there was a little"
BODY = {"model": "stories", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2, "echo": True}


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    model = with_metaspace_tokenizer(stories_dir, tmp_path_factory.mktemp("metaspace") / "stories")
    with serve_in_thread(settings_for(model, served_model_names=("stories",), chat_template=CHAT_TEMPLATE)) as running:
        yield running


def streamed(url: str, body: dict) -> dict:
    """The stream's choice 0 flattened: its text, tokens, offsets and top logprobs in order."""
    out = {"text": "", "tokens": [], "text_offset": [], "top_logprobs": []}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                out["text"] += choice["text"]
                for key in ("tokens", "text_offset", "top_logprobs"):
                    out[key] += (choice["logprobs"] or {}).get(key, [])
    return out


def assert_offsets_run_over_the_tokens(lp: dict) -> None:
    tokens, offsets = lp["tokens"], lp["text_offset"]
    assert offsets[0] == 0 and len(offsets) == len(tokens)
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], tokens)), list(zip(tokens, offsets))


def test_echo_logprobs_are_vllms(server):
    r = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    num_prompt = len(server.engine.tokenizer(PROMPT).input_ids)
    assert lp["tokens"][0] == "<s>" and lp["token_logprobs"][0] is None
    assert "".join(lp["tokens"][1:num_prompt]) == " " + PROMPT  # each word's piece keeps its space
    assert_offsets_run_over_the_tokens(lp)
    texts = lp["tokens"] + [t for top in lp["top_logprobs"] if top for t in top]
    assert not any(t.endswith("\ufffd") for t in texts)
    stream = streamed(server.url, BODY)
    assert stream["text"] == choice["text"]
    assert {k: stream[k] for k in ("tokens", "text_offset", "top_logprobs")} == \
        {k: lp[k] for k in ("tokens", "text_offset", "top_logprobs")}


def test_completion_logprobs_without_echo_start_at_zero(server):
    body = {**BODY, "echo": False}
    lp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 12
    assert_offsets_run_over_the_tokens(lp)
    assert streamed(server.url, body)["text_offset"] == lp["text_offset"]


def test_chat_logprobs_keep_leading_spaces(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "stories", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0,
        "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    for item in content:
        assert item["bytes"] == list(item["token"].encode()) and not item["token"].endswith("\ufffd")
    spaced = [item["token"] for item in content if item["token"].startswith(" ")]
    vocab = server.engine.tokenizer.get_vocab()
    assert spaced and all("\u2581" + t[1:] in vocab for t in spaced), content  # "▁she" read as " she"
