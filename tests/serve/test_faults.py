"""Faults: an exception in one engine step fails that step's requests with 500 and the server goes on (or
says it is dead on /health), never hangs; a client that reads its stream very slowly stalls no one else."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests_support.live_server import assert_quiescent, stories_settings
from tests_support.serving import serve_in_thread

pytestmark = pytest.mark.slow
LONG = {"max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(stories_dir):
    settings = stories_settings(stories_dir, max_num_seqs=8)
    with serve_in_thread(settings) as running:
        yield running


def stream_events(url: str, prompt: str, headers_seen: threading.Event | None = None, **fields) -> list[dict | str]:
    out = []
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "stream": True, **LONG, **fields}) as r:
        assert r.status_code == 200
        if headers_seen is not None:
            headers_seen.set()
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def test_an_exception_in_one_step_fails_its_requests_with_500_and_the_server_goes_on(server):
    runner, failed = server.engine.runner, threading.Event()
    real_execute = runner.execute
    seen = [threading.Event(), threading.Event()]  # each stream's client has its 200 and headers

    def execute_once_broken(out):
        # A decode step of all four once both streams' clients hold their headers: the fault reaches them
        # mid-stream (the engine may make a stream's first tokens before the server sends its headers).
        if (not failed.is_set() and len(out.chunks) >= 4 and all(c.request.num_output_tokens for c in out.chunks)
                and all(e.is_set() for e in seen)):
            failed.set()
            raise RuntimeError("injected fault")
        return real_execute(out)

    runner.execute = execute_once_broken
    try:
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream_events, server.url, f"Once upon a time {i}", seen[i]) for i in range(2)]
            plain = [pool.submit(httpx.post, server.url + "/v1/completions", timeout=60,
                                 json={"prompt": f"A dog {i}", **LONG}) for i in range(2)]
            events = [f.result(timeout=90) for f in streams]
            answers = [f.result(timeout=90) for f in plain]
    finally:
        runner.execute = real_execute
    assert failed.is_set()
    for ev in events:  # headers went out before the fault: an error event, then [DONE]
        assert ev[-1] == "[DONE]"
        assert ev[-2]["error"]["code"] == 500 and "injected fault" in ev[-2]["error"]["message"], ev[-2:]
    assert [a.status_code for a in answers] == [500, 500], [a.text for a in answers]
    assert "injected fault" in answers[0].json()["error"]["message"]
    # The engine went on: healthy, and it serves the next request.
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    again = httpx.post(server.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 8}, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8
    assert_quiescent(server)


def test_a_slow_reader_does_not_stall_other_streams(server):
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Once upon a time", "stream": True, "max_tokens": 250, "ignore_eos": True})
    slow = socket.create_connection((host, int(port)))
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and it reads nothing: its window fills
    slow.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    try:
        time.sleep(0.5)
        start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            others = [pool.submit(stream_events, server.url, f"A cat {i}", max_tokens=64) for i in range(4)]
            results = [f.result(timeout=60) for f in others]
        took = time.monotonic() - start
        assert all(r[-1] == "[DONE]" and r[-2]["choices"][0]["finish_reason"] == "length" for r in results)
        print(f"4 streams of 64 tokens beside a reader that reads nothing: {took:.2f} s")
    finally:
        slow.close()
    assert_quiescent(server)
