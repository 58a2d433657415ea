"""SIGTERM on a real `quantkit serve` process: admission stops (503), requests in flight finish (or
are aborted past --shutdown-timeout, with finish_reason and [DONE]), the process exits 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from tests_support.serving import free_port, start_subprocess, wait_health

pytestmark = pytest.mark.slow  # two server processes: start-up dominates


def stream_in_thread(url: str, body: dict):
    """Start a streaming request; returns (first chunk event, results dict filled when it ends)."""
    first, result = threading.Event(), {}

    def run():
        chunks = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    first.set()
        result["chunks"] = chunks

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return first, result, t


@pytest.fixture
def server_process(stories_dir):
    procs = []

    def start(*args):
        port = free_port()
        proc = start_subprocess(stories_dir, port, *args)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_health(url)
        return proc, url

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def finish_reasons(chunks: list[str]) -> list[str]:
    objs = [json.loads(c) for c in chunks if c != "[DONE]"]
    return [ch["finish_reason"] for o in objs for ch in o["choices"] if ch["finish_reason"]]


def test_sigterm_drains_in_flight_refuses_new_and_exits_0(server_process):
    proc, url = server_process("--shutdown-timeout", "60")
    # in flight long enough (hundreds of engine steps) that the probe below lands while it drains
    first, result, t = stream_in_thread(url, {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True})
    assert first.wait(60)
    proc.send_signal(signal.SIGTERM)
    wait_health(url, want=503, timeout=30)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    t.join(120)
    assert result["chunks"][-1] == "[DONE]"
    assert finish_reasons(result["chunks"]) == ["length"]
    assert proc.wait(timeout=60) == 0


def test_sigterm_past_the_timeout_aborts_with_finish_reason(server_process):
    proc, url = server_process("--shutdown-timeout", "0")
    first, result, t = stream_in_thread(url, {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True})
    assert first.wait(60)
    proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert result["chunks"][-1] == "[DONE]"
    assert finish_reasons(result["chunks"]) == ["abort"]
    assert proc.wait(timeout=60) == 0
    assert "draining" in proc.stdout.read()
