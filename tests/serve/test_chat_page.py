"""The chat page at / in a real headless Chromium (Debian's, driven by Playwright): pick the model, send a
prompt, see the answer stream in, stop it (the server aborts the request). The screenshot is kept in
test-output/ as an artifact."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tests_support.live_server import assert_quiescent, stories_settings, value
from tests_support.serving import serve_in_thread

pytestmark = pytest.mark.slow
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-output"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--no-first-run", "--disable-sync"]
KEY = "sk-page"


def chromium_path() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("chromium not installed (Debian package `chromium`; .ci/run installs it)")
    return path


def test_chat_page_streams_and_stops(stories_dir):
    executable = chromium_path()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency")
    settings = stories_settings(stories_dir, api_keys=(KEY,), max_num_seqs=4)
    # paced: stories260K writes 200 tokens faster than a browser clicks, so the Stop would find the answer done
    with serve_in_thread(settings) as server, server.paced(0.02), sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1000, "height": 700})
        try:
            page.goto(server.url + "/")
            page.fill("#key", KEY)
            page.dispatch_event("#key", "change")  # stored in localStorage, models reloaded with it
            page.wait_for_function("document.querySelector('#model').value === 'stories'", timeout=15000)
            page.fill("#max-tokens", "200")  # + the prompt, within max_model_len 256
            page.fill("#prompt", "Tell me a story about a cat")
            page.click("#send")
            answer = page.locator(".msg.assistant").last
            page.wait_for_function(
                "document.querySelectorAll('.msg.assistant')[0].textContent.length > 10", timeout=30000)
            page.click("#stop")
            page.wait_for_function(  # the page reports the stop once the fetch is aborted
                "[...document.querySelectorAll('.msg.error')].some(e => e.textContent === 'stopped')", timeout=10000)
            text = answer.text_content()
            assert len(text) > 10
            assert "TTFT" in page.text_content("#stats") and "tokens/s" in page.text_content("#stats")
            assert page.evaluate("localStorage.getItem('quantkit-api-key')") == KEY
        finally:
            ARTIFACTS.mkdir(exist_ok=True)  # kept whether the test passed or not: it shows what the page did
            page.screenshot(path=str(ARTIFACTS / "chat_page.png"), full_page=True)
            browser.close()
        # The stop reached the server: the request was aborted there, not run to its 200 tokens.
        assert_quiescent(server)
        assert value(server.url, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 1
        assert value(server.url, "vllm:generation_tokens", "vllm:generation_tokens_total") < 200


def test_three_turns_on_a_small_context_model(stories_dir):
    """A model of 256 tokens' context. Turn 1 with the page's default max tokens (what the context leaves after
    the prompt) succeeds; New chat clears the conversation; turn 2 asks for more tokens than the context holds and
    fails, and is kept out of what later turns send; turn 3 succeeds and sends only its own message."""
    executable = chromium_path()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency")
    sent: list[dict] = []
    with serve_in_thread(stories_settings(stories_dir, max_num_seqs=4)) as server, \
            sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1000, "height": 700})
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)

        def turn(text: str, max_tokens: str = "") -> None:
            page.fill("#max-tokens", max_tokens)
            page.fill("#prompt", text)
            page.click("#send")
            page.wait_for_function("!document.querySelector('#send').disabled", timeout=60000)

        try:
            page.goto(server.url + "/")
            page.wait_for_function("document.querySelector('#model').value === 'stories'", timeout=15000)
            assert "256" in page.text_content("#context")
            turn("Tell me a story about a cat")
            assert page.locator(".msg.error").count() == 0, page.text_content("#log")
            assert len(page.locator(".msg.assistant").last.text_content()) > 10
            assert "max_tokens" not in sent[0]  # the server gives it what the context leaves, as vLLM does
            page.click("#new-chat")
            assert page.locator(".msg").count() == 0
            turn("Tell me a story about a dog", "1000")
            assert "maximum context length is 256 tokens" in page.locator(".msg.error").last.text_content()
            assert page.locator(".msg.user.failed").count() == 1
            turn("Tell me a story about a bird", "16")
            assert page.locator(".msg.error").count() == 1  # only turn 2's
            assert [m["content"] for m in sent[-1]["messages"]] == ["Tell me a story about a bird"]
            assert sent[-1]["max_tokens"] == 16
        finally:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "chat_page_three_turns.png"), full_page=True)
            browser.close()
        assert len(sent) == 3
        assert_quiescent(server)
