"""Two `quantkit serve` replicas behind a real nginx running deploy/nginx/quantkit.conf: streams pass token
by token, load spreads over both, and with one replica SIGKILLed mid-run non-streaming requests keep
succeeding through the other."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests_support.deploy_configs import nginx_config
from tests_support.live_server import CHAT_TEMPLATE, assert_quiescent, value
from tests_support.serving import free_port, start_subprocess, wait_health

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, stories_dir):
    binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if binary is None:
        pytest.skip("nginx not installed (Debian package `nginx`; .ci/run installs it)")
    folder = tmp_path_factory.mktemp("nginx")
    (folder / "chat.jinja").write_text(CHAT_TEMPLATE)
    ports = [free_port(), free_port()]
    replicas = [start_subprocess(stories_dir, p, "--served-model-name", "stories", "--max-model-len", "256",
                                 "--kv-cache-memory", "8MiB", "--shutdown-timeout", "2") for p in ports]
    proxy = None
    try:
        for p in ports:
            wait_health(f"http://127.0.0.1:{p}", timeout=180)
        listen = free_port()
        conf = nginx_config(folder, listen, ports)
        proxy = subprocess.Popen([binary, "-c", str(conf), "-e", str(folder / "error.log")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_health(f"http://127.0.0.1:{listen}", timeout=30)
        yield f"http://127.0.0.1:{listen}", [f"http://127.0.0.1:{p}" for p in ports], replicas, folder
    finally:
        if proxy is not None:
            proxy.send_signal(signal.SIGQUIT)  # nginx's graceful stop
            proxy.wait(20)
        for r in replicas:
            if r.poll() is None:
                r.send_signal(signal.SIGTERM)
                r.wait(30)


def completions(url: str, i: int, max_tokens: int = 12) -> int:
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"prompt": f"Once upon a time {i}", "max_tokens": max_tokens}).status_code


def test_streams_pass_token_by_token(gateway):
    url, *_ = gateway
    arrivals, events = [], []
    # long enough for many events even where the engine outpaces the event loop and a chunk carries several tokens
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        buffer = ""
        for piece in r.iter_raw():
            buffer += piece.decode()
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                events.append(event)
                arrivals.append(time.monotonic())
    assert events[-1] == "data: [DONE]"
    tokens = [json.loads(e[6:]) for e in events[:-1]]
    assert sum(1 for t in tokens if t["choices"] and t["choices"][0]["text"]) >= 30
    # Unbuffered: the events arrive spread over the generation, not in one burst at its end.
    span = arrivals[-1] - arrivals[0]
    first_half = sum(1 for t in arrivals if t < arrivals[0] + span / 2)
    assert span > 0 and 5 <= first_half <= len(arrivals) - 5, (span, first_half, len(arrivals))


def test_load_spreads_over_both_replicas(gateway):
    url, replicas, *_ = gateway
    before = [value(r, "http_requests", "http_requests_total", handler="/v1/completions") for r in replicas]
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: completions(url, i), range(24)))
    assert codes == [200] * 24
    after = [value(r, "http_requests", "http_requests_total", handler="/v1/completions") for r in replicas]
    served = [a - b for a, b in zip(after, before)]
    assert sum(served) == 24 and min(served) >= 4, served
    print(f"24 requests through nginx: {served[0]:.0f} and {served[1]:.0f} per replica")


def test_killing_one_replica_mid_run_keeps_requests_succeeding(gateway):
    url, replicas, procs, folder = gateway
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(completions, url, i, 24) for i in range(40)]
        time.sleep(1.0)  # some are in flight on each replica
        procs[0].send_signal(signal.SIGKILL)
        codes = [f.result(timeout=120) for f in futures]
    procs[0].wait(10)
    assert codes == [200] * 40, codes
    # The kill did hit traffic: nginx logged the dead upstream and passed those requests to the other.
    assert "upstream" in (folder / "error.log").read_text()
    assert completions(url, 99) == 200
    assert_quiescent(replicas[1])
