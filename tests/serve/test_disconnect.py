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
