"""Every error by status and body (OpenAI's shape), with the server still serving afterwards."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from tests_support.serving import serve_in_thread, settings_for, wait_health


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    return err


def still_serves(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Once", "max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "Once", "temperature": -1}, None),
    ({"prompt": "Once", "top_p": 0}, None),
    ({"prompt": "Once", "max_tokens": 0}, None),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    # echo decodes the prompt before the engine sees it: an id the tokenizer cannot hold is still a 400
    ({"prompt": [[-2930672], [2773, -496]], "echo": True}, "prompt"),
    ({"prompt": [1, 2**40], "echo": True, "max_tokens": 2}, "prompt"),
])
def test_bad_requests_are_400_never_422(stories_server, body, param):
    r = httpx.post(f"{stories_server.url}/v1/completions", json=body, timeout=60)
    err = assert_error(r, 400)
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param
    still_serves(stories_server.url)


def test_invalid_json_is_400(stories_server):
    r = httpx.post(f"{stories_server.url}/v1/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert_error(r, 400)


@pytest.mark.parametrize("body, what, where", [
    (b'{"model": "x", "prompt": "hi",, }', "Expecting property name enclosed in double quotes", "line 1 column 31"),
    (b'{"model": "x",\n "prompt": "hi"', "Expecting ',' delimiter", "line 2 column 16"),
])
def test_malformed_json_says_what_and_where(stories_server, body, what, where):
    """vLLM's 400 names the decoder's complaint and the offset (param "body.<char>"); ours says both, and the
    line and column, in the message."""
    r = httpx.post(f"{stories_server.url}/v1/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})
    err = assert_error(r, 400)
    pos = body.index(b",,") + 1 if b",," in body else len(body)
    assert what in err["message"] and where in err["message"] and f"char {pos}" in err["message"], err
    assert err["param"] == f"body.{pos}"


def test_context_overflow_uses_vllms_wording(stories_server):
    r = httpx.post(f"{stories_server.url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 600})
    assert_error(r, 400, "This model's maximum context length is 512 tokens. However, you requested 605 tokens "
                         "(5 in the messages, 600 in the completion)")
    r = httpx.post(f"{stories_server.url}/v1/completions", json={"prompt": list(range(3, 600)), "max_tokens": 1})
    assert_error(r, 400, "This model's maximum context length is 512 tokens. However, your request has 597 input")
    still_serves(stories_server.url)


def test_unknown_model_is_404(stories_server):
    r = httpx.post(f"{stories_server.url}/v1/completions", json={"model": "gpt-9", "prompt": "Once"})
    err = assert_error(r, 404, "gpt-9")
    assert err["code"] == "model_not_found"
    still_serves(stories_server.url)


def test_chat_without_template_is_400_naming_the_flag(stories_server):
    r = httpx.post(f"{stories_server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert_error(r, 400, "--chat-template")
    still_serves(stories_server.url)


def test_api_keys_bearer_and_public_paths(stories_dir, monkeypatch):
    from quantkit.commands.serve import api_keys

    monkeypatch.setenv("QUANTKIT_API_KEY", "env-key")
    assert api_keys(None) == ("env-key",) and api_keys(["a"]) == ("a",)
    with serve_in_thread(settings_for(stories_dir, api_keys=("k1", "k2"))) as srv:
        body = {"prompt": "Once", "max_tokens": 2}
        assert_error(httpx.post(f"{srv.url}/v1/completions", json=body), 401, "API key")
        assert_error(httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": "Bearer no"}), 401)
        assert_error(httpx.get(f"{srv.url}/v1/models"), 401)
        for key in ("k1", "k2"):
            r = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert httpx.get(f"{srv.url}/version").json()["version"]


def test_loading_is_503_then_ready(stories_dir):
    from quantkit.serve.runner import make_front

    settings = settings_for(stories_dir)
    release = threading.Event()

    def slow_front():
        release.wait(60)
        return make_front(settings)

    with serve_in_thread(settings, make_llm=slow_front, ready=False) as srv:
        wait_health(srv.url, want=503)
        err = assert_error(httpx.get(f"{srv.url}/health"), 503, "loading")
        assert err["type"] == "service_unavailable"
        assert_error(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Once"}), 503, "loading")
        release.set()
        wait_health(srv.url)
        still_serves(srv.url)


def test_queue_full_is_429_with_retry_after(stories_dir):
    settings = settings_for(stories_dir, max_num_seqs=1, max_queued_requests=1)
    with serve_in_thread(settings) as srv:
        long = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}

        async def scenario():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                async def hold():  # stream until told to stop: keeps its request in the engine
                    async with c.stream("POST", "/v1/completions", json=long) as r:
                        async for _ in r.aiter_lines():
                            if done.is_set():
                                return

                done = asyncio.Event()
                a = asyncio.ensure_future(hold())
                await wait_for(lambda: srv.state.llm.num_running() == 1)
                b = asyncio.ensure_future(hold())
                await wait_for(lambda: srv.state.llm.num_waiting() == 1)
                r = await c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
                done.set()
                await asyncio.gather(a, b)
                return r

        r = asyncio.run(scenario())
        assert_error(r, 429, "overloaded")
        assert r.headers["retry-after"] == "1"
        srv.wait_idle()
        still_serves(srv.url)


async def wait_for(cond, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_engine_failure_is_500_and_health_503(stories_dir):
    with serve_in_thread(settings_for(stories_dir)) as srv:
        def broken_step():
            raise RuntimeError("simulated kernel failure")

        body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")  # headers are out: an error now is an SSE event
            srv.engine.step = broken_step
            rest = [ln for ln in lines if ln]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["error"]["message"].endswith("simulated kernel failure")
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=60)
        assert_error(r, 500, "simulated kernel failure")
        assert_error(httpx.get(f"{srv.url}/health"), 503, "simulated kernel failure")
        assert_error(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Once"}, timeout=60), 500)
