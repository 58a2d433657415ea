"""A client that leaves, streaming or not, aborts its request: running drops to 0 and every KV
block is back in the free pool (asserted on the in-process engine's block pool)."""

from __future__ import annotations

import httpx
import pytest

LONG = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "temperature": 0}


def generated(srv) -> int:
    return srv.state.llm.get_stats().generation_tokens


def assert_all_blocks_free(srv) -> None:
    srv.wait_idle()
    assert srv.state.llm.num_running() == 0 and srv.state.llm.num_waiting() == 0
    assert srv.free_blocks() == srv.engine.kv_plan.num_blocks


def test_disconnect_mid_stream_aborts(stories_server):
    before = generated(stories_server)
    with httpx.stream("POST", f"{stories_server.url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(10)]  # some chunks, then close the connection
    assert sum(1 for ln in got if ln.startswith("data: ")) >= 3
    assert_all_blocks_free(stories_server)
    assert generated(stories_server) - before < LONG["max_tokens"]


def test_disconnect_mid_request_aborts(stories_server):
    # four samples of 480 tokens take about 1.4 s here; the client leaves after 0.3 s
    many = {**LONG, "n": 4, "temperature": 1.0, "seed": 0}
    before = generated(stories_server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stories_server.url}/v1/completions", json=many, timeout=httpx.Timeout(60, read=0.3))
    assert_all_blocks_free(stories_server)
    assert generated(stories_server) - before < many["n"] * many["max_tokens"]
    r = httpx.post(f"{stories_server.url}/v1/completions", json={**LONG, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_stream_disconnected_while_queued_is_a_clean_499(stories_dir, caplog):
    """One sequence at a time, paced: a streaming request waits in the queue behind a long one, and its client
    leaves before its first token. The request is aborted, counted as HTTP 499 (as a non-streaming disconnect
    is), and nothing is logged at ERROR (no traceback from the stream's wait for its first output)."""
    import logging
    import threading

    from tests_support.live_server import value
    from tests_support.serving import serve_in_thread, settings_for

    uvicorn_errors = logging.getLogger("uvicorn.error")  # uvicorn's own loggers do not reach the root's handler
    uvicorn_errors.addHandler(caplog.handler)
    caplog.set_level(logging.ERROR)
    settings = settings_for(stories_dir, served_model_names=("stories",), max_num_seqs=1)
    try:
        with serve_in_thread(settings) as server, server.paced(0.02):
            url = f"{server.url}/v1/completions"
            ahead = threading.Thread(target=lambda: httpx.post(url, json={**LONG, "max_tokens": 100}, timeout=60))
            ahead.start()
            while server.state.llm.num_running() == 0:  # the long request holds the only sequence slot
                pass
            with pytest.raises(httpx.ReadTimeout):  # no headers before the first token: the client gives up
                with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=httpx.Timeout(60, read=0.5)):
                    pass
            ahead.join(timeout=60)
            assert_all_blocks_free(server)
            statuses = {s: value(server.url, "http_requests", "http_requests_total", handler="/v1/completions",
                                 status=s) for s in ("200", "499", "500")}
            assert statuses == {"200": 1, "499": 1, "500": 0}
            assert value(server.url, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 1
    finally:
        uvicorn_errors.removeHandler(caplog.handler)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
