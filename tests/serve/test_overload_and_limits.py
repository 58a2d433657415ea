"""Under load and over limits: a bounded queue answers 429 at once and /ready says so; per-key rate limits
admit exactly their allowance, then 429 with a Retry-After that, honoured, succeeds."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from tests_support.live_server import assert_quiescent, stories_settings, value
from tests_support.serving import serve_in_thread

pytestmark = pytest.mark.slow
OPEN_KEY, BURST_KEY, RPM = "sk-open", "sk-burst", 30  # 30 a minute: one more every 2 s


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir):
    keys = tmp_path_factory.mktemp("limits") / "keys.toml"
    keys.write_text(f'[[keys]]\nname = "open"\nkey = "{OPEN_KEY}"\n'
                    f'[[keys]]\nname = "burst"\nkey = "{BURST_KEY}"\nrequests_per_minute = {RPM}\n')
    settings = stories_settings(stories_dir, api_keys_file=keys, max_queued_requests=8, max_num_seqs=4,
                                max_model_len=512)  # stories260K's whole context: long generations below
    with serve_in_thread(settings) as running:
        yield running


@pytest.fixture(autouse=True)
def quiescent_after(server):
    yield
    assert_quiescent(server)


def test_overload_surplus_gets_429_at_once_and_admitted_complete(server):
    # long enough generations that the queue stays full for many /ready polls (hundreds of engine steps)
    max_tokens = 480  # the prompt (< 32 tokens) + this stays within max_model_len 512
    ready_codes: list[int] = []
    stop = threading.Event()

    def watch_ready():
        while not stop.is_set():
            ready_codes.append(httpx.get(server.url + "/ready", timeout=5).status_code)
            time.sleep(0.005)

    async def one(client, i):
        start = time.monotonic()
        r = await client.post("/v1/completions", json={"prompt": f"Once upon a time {i}", "max_tokens": max_tokens,
                                                       "ignore_eos": True})
        return r.status_code, time.monotonic() - start, r

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {OPEN_KEY}"},
                                     limits=httpx.Limits(max_connections=100)) as client:
            # Four fill the running batch first. (A request not yet scheduled counts as queued: sent all at
            # once, 8 would fill the queue before the engine had scheduled any, and the queue would hold only
            # 4 once it had.) The other 96 then find 8 places in the queue, held for the first four's 480 steps.
            first = [asyncio.create_task(one(client, i)) for i in range(4)]
            deadline = time.monotonic() + 30
            while server.state.llm.num_running() < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            rest = await asyncio.gather(*(one(client, i) for i in range(4, 100)))
            return [*await asyncio.gather(*first), *rest]

    watcher = threading.Thread(target=watch_ready)
    watcher.start()
    try:
        with server.paced(0.002):  # the first four's 480 steps take >= 1 s, however fast this machine is
            results = asyncio.run(burst())
    finally:
        stop.set()
        watcher.join()
    ok = [r for code, _, r in results if code == 200]
    rejected = [(s, r) for code, s, r in results if code == 429]
    assert len(ok) + len(rejected) == 100, sorted({code for code, _, _ in results})
    assert len(rejected) >= 100 - 4 - 8 - 8  # 4 running + 8 queued, and some admitted as others finish
    assert all(r.headers["retry-after"] and r.json()["error"]["code"] for _, r in rejected)
    slowest_429 = max(s for s, _ in rejected)
    fastest_ok, slowest_ok = (f(s for code, s, _ in results if code == 200) for f in (min, max))
    assert slowest_429 < slowest_ok, "a 429 waited for a generation slot"
    assert all(r.json()["usage"]["completion_tokens"] == max_tokens for r in ok)
    assert 503 in ready_codes and ready_codes[-1] == 200
    assert value(server.url, "quantkit:requests_rejected", "quantkit:requests_rejected_total",
                 reason="queue_full") == len(rejected)
    print(f"overload: {len(ok)} admitted, {len(rejected)} got 429 within {slowest_429 * 1000:.0f} ms "
          f"(first 200 after {fastest_ok:.2f} s); {ready_codes.count(503)} of {len(ready_codes)} /ready polls said 503")


def test_rate_limit_exact_burst_then_retry_after_honoured(server):
    auth = {"Authorization": f"Bearer {BURST_KEY}"}
    body = {"prompt": "Once", "max_tokens": 1}

    async def burst():  # the bucket refills one request per 2 s; the burst takes far less
        gate = asyncio.Semaphore(4)  # within the engine's 4 running: no queue-full 429 here

        async def one(client):
            async with gate:
                return await client.post("/v1/completions", json=body)

        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=auth) as client:
            return await asyncio.gather(*(one(client) for _ in range(RPM + 5)))

    start = time.monotonic()
    answers = asyncio.run(burst())
    took = time.monotonic() - start
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] * RPM + [429] * 5, f"{codes} in {took:.2f} s: {[r.text for r in answers if r.status_code == 429]}"
    refused = [r for r in answers if r.status_code == 429]
    err = refused[-1].json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests_per_minute"
    retry_after = max(int(r.headers["retry-after"]) for r in refused)
    assert 1 <= retry_after <= 2
    time.sleep(retry_after)
    assert httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
    assert value(server.url, "quantkit:api_key_rate_limited", "quantkit:api_key_rate_limited_total",
                 key_name="burst", limit="requests_per_minute") == 5
    print(f"rate limit: {RPM} admitted and 5 refused in a burst of {took:.2f} s; Retry-After {retry_after} s")
