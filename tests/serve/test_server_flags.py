"""The server flags users look for (vLLM's names), each on a real server: --seed, --max-logprobs, --tokenizer, CORS,
--root-path behind a real nginx that strips the prefix, --uds through httpx's Unix-socket transport and the official
client, --speculative-config with its counters in /metrics."""

from __future__ import annotations

import shutil
import signal
import subprocess

import httpx
import openai
import pytest

from tests_support.live_server import CHAT_TEMPLATE, value
from tests_support.serving import free_port, serve_in_thread, settings_for, wait_health

KEY = "sk-flags"
ORIGIN = "https://app.example"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def flagged(stories_dir):
    """stories260K with --seed 1234, --max-logprobs 5, one allowed origin with credentials, --root-path /llm, a key."""
    settings = settings_for(stories_dir, served_model_names=("stories",), seed=1234, max_logprobs=5,
                            allowed_origins=(ORIGIN,), allow_credentials=True, root_path="/llm", api_keys=(KEY,),
                            chat_template=CHAT_TEMPLATE)
    with serve_in_thread(settings) as running:
        yield running


def client_for(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60, **kw)


def sample(client, **kw) -> str:
    return client.completions.create(model="stories", prompt=PROMPT, max_tokens=24, temperature=1.0, **kw).choices[0].text


def test_seed_is_the_default_of_requests_without_one(flagged, client):
    seeded = client_for(flagged.url)
    first, again = sample(seeded), sample(seeded)
    assert first == again == sample(seeded, seed=1234)  # as if each had sent seed 1234
    assert sample(seeded, seed=7) != first  # a request's own seed wins
    # without --seed (the shared server), requests without a seed draw afresh
    assert len({sample(client) for _ in range(3)}) > 1
    chat = seeded.chat.completions.create  # chat too, and each of n samples (seed + i, as vLLM's)
    two = [chat(model="stories", messages=[{"role": "user", "content": "hi"}], max_tokens=12, n=2) for _ in range(2)]
    assert [c.message.content for c in two[0].choices] == [c.message.content for c in two[1].choices]


def test_max_logprobs_refuses_above_the_limit_naming_it(flagged):
    c = client_for(flagged.url)
    ok = c.completions.create(model="stories", prompt=PROMPT, max_tokens=2, logprobs=5)
    assert len(ok.choices[0].logprobs.top_logprobs[0]) == 5
    for call in (lambda: c.completions.create(model="stories", prompt=PROMPT, max_tokens=2, logprobs=6),
                 lambda: c.chat.completions.create(model="stories", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2, logprobs=True, top_logprobs=6),
                 lambda: c.completions.create(model="stories", prompt=PROMPT, max_tokens=2, logprobs=6, stream=True)):
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert "greater than max allowed: 5" in caught.value.message
    flagged.wait_idle()


def test_the_default_max_logprobs_is_20(client):
    with pytest.raises(openai.BadRequestError, match="greater than max allowed: 20"):
        client.completions.create(model="stories", prompt=PROMPT, max_tokens=2, logprobs=21)
    assert len(client.completions.create(model="stories", prompt=PROMPT, max_tokens=1,
                                         logprobs=20).choices[0].logprobs.top_logprobs[0]) == 20


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(f"{url}/v1/chat/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_preflight_and_responses(flagged, stories_server):
    r = preflight(flagged.url, ORIGIN)  # answered without a key: browsers send none on a preflight
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    refused = preflight(flagged.url, "https://evil.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    # a real request's answer carries the header, a 401 too (so the page can read why)
    ok = httpx.get(f"{flagged.url}/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    unauthorized = httpx.get(f"{flagged.url}/v1/models", headers={"Origin": ORIGIN})
    assert ok.status_code == 200 and unauthorized.status_code == 401
    assert ok.headers["access-control-allow-origin"] == unauthorized.headers["access-control-allow-origin"] == ORIGIN
    # vLLM's defaults: any origin, method and header
    anywhere = preflight(stories_server.url, "https://elsewhere.example")
    assert anywhere.status_code == 200 and anywhere.headers["access-control-allow-origin"] == "*"


def test_root_path_behind_a_proxy_that_strips_it(flagged, tmp_path):
    binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if binary is None:
        pytest.skip("nginx not installed (Debian package `nginx`)")
    port, upstream = free_port(), flagged.url.rsplit(":", 1)[1]
    temp = "\n".join(f"{k}_temp_path {tmp_path / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (tmp_path / "nginx.conf").write_text(
        f"daemon off; worker_processes 1; pid {tmp_path / 'nginx.pid'}; error_log {tmp_path / 'error.log'} warn;\n"
        f"events {{ worker_connections 64; }}\nhttp {{ access_log off; {temp}\n"
        f"  server {{ listen 127.0.0.1:{port};\n"
        f"    location /llm/ {{ proxy_pass http://127.0.0.1:{upstream}/; proxy_buffering off; }} }} }}\n")
    proxy = subprocess.Popen([binary, "-c", str(tmp_path / "nginx.conf"), "-e", str(tmp_path / "error.log")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}/llm"
        wait_health(base, timeout=30)  # public behind the prefix too, with keys on
        got = client_for(base).completions.create(model="stories", prompt=PROMPT, max_tokens=4, temperature=0)
        assert got.choices[0].text
        assert httpx.get(f"{base}/openapi.json", timeout=10).json()["servers"] == [{"url": "/llm"}]
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401  # the keys still hold
        page = httpx.get(f"{base}/", timeout=10).text  # the chat page calls the API relative to where it is
        assert 'fetch("v1/chat/completions"' in page and 'fetch("/v1/' not in page
    finally:
        proxy.send_signal(signal.SIGQUIT)
        proxy.wait(20)


def test_uds(stories_dir, tmp_path):
    sock = tmp_path / "quantkit.sock"
    settings = settings_for(stories_dir, served_model_names=("stories",), uds=sock)
    with serve_in_thread(settings):
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=60) as http:
            assert http.get("http://localhost/health").status_code == 200
            c = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=http, max_retries=0)
            assert c.completions.create(model="stories", prompt=PROMPT, max_tokens=4).choices[0].text
            assert [m.id for m in c.models.list()] == ["stories"]
        with pytest.raises(httpx.ConnectError):  # the socket instead of host:port, not beside it
            httpx.get(f"http://127.0.0.1:{settings.port}/health", timeout=5)


def test_tokenizer_flag(stories_dir, tmp_path):
    """Another tokenizer (the synthetic BPE, same vocabulary size as stories260K's): the server encodes with it."""
    from transformers import AutoTokenizer

    from quantkit.calibration.synthetic import build_tokenizer

    build_tokenizer(vocab_size=512).save_pretrained(tmp_path / "tok")
    text = "the cat sat on the mat"
    mine = AutoTokenizer.from_pretrained(tmp_path / "tok")(text).input_ids
    assert mine != AutoTokenizer.from_pretrained(stories_dir)(text).input_ids
    with serve_in_thread(settings_for(stories_dir, served_model_names=("stories",),
                                      tokenizer=str(tmp_path / "tok"))) as running:
        got = httpx.post(f"{running.url}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
        c = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0, timeout=60)
        usage = c.completions.create(model="stories", prompt=text, max_tokens=2).usage
    assert got == mine and usage.prompt_tokens == len(mine)


def test_speculative_config_on_serve(stories_dir, stories_server):
    """n-gram speculation on a server: greedy text as without it, and vLLM's spec_decode counters in /metrics."""
    prompt = "Lily had a red ball. Lily had a red ball. Lily had a red ball. Lily had"
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}

    def greedy(url):
        return httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "stories", "prompt": prompt, "max_tokens": 32, "temperature": 0}).json()["choices"][0]["text"]

    with serve_in_thread(settings_for(stories_dir, served_model_names=("stories",),
                                      speculative_config=spec)) as running:
        assert greedy(running.url) == greedy(stories_server.url)
        drafts = value(running.url, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total")
        proposed = value(running.url, "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total")
        accepted = value(running.url, "vllm:spec_decode_num_accepted_tokens",
                         "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed
    assert value(stories_server.url, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total") == 0
