"""/metrics of a live `quantkit serve`: every family, the Grafana dashboard's metrics, and a real Prometheus
scraping it."""

from __future__ import annotations

import math
import shutil
import subprocess
import threading
import time

import httpx
import pytest
from tests_support.deploy_configs import prometheus_config
from tests_support.live_server import FAMILIES, assert_quiescent, scrape, stories_settings, value
from tests_support.promql import dashboard_queries, metric_names
from tests_support.serving import free_port, serve_in_thread

pytestmark = pytest.mark.slow

KEY = "sk-live-metrics"


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_dir):
    keys = tmp_path_factory.mktemp("live-metrics") / "keys.toml"
    keys.write_text(f'[[keys]]\nname = "dashboards"\nkey = "{KEY}"\nrequests_per_minute = 100000\n')
    with serve_in_thread(stories_settings(stories_dir, api_keys_file=keys)) as running:
        yield running


@pytest.fixture(autouse=True)
def quiescent_after(server):
    yield
    assert_quiescent(server)


def traffic(server, n: int = 4, max_tokens: int = 16) -> None:
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        for i in range(n):
            r = c.post("/v1/completions", json={"prompt": f"Once upon a time {i}", "max_tokens": max_tokens})
            assert r.status_code == 200, r.text
            with c.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": max_tokens,
                    "stream": True}) as s:
                assert s.status_code == 200
                assert list(s.iter_lines())[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in s.read().decode()


def test_live_scrape_has_every_family(server):
    traffic(server, n=2)
    fams = scrape(server.url)
    for name, kind in FAMILIES.items():
        assert name in fams, name
        assert fams[name].type == kind and fams[name].documentation, name
    assert value(server.url, "vllm:generation_tokens", "vllm:generation_tokens_total") >= 4 * 16
    assert value(server.url, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") >= 4
    assert value(server.url, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") >= 4 * 15
    assert value(server.url, "vllm:request_success", "vllm:request_success_total", finished_reason="length") >= 4
    assert value(server.url, "quantkit:model_weights_bytes") > 0
    assert value(server.url, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") >= 16
    assert value(server.url, "quantkit:api_key_requests", "quantkit:api_key_requests_total", key_name="dashboards") >= 4
    assert value(server.url, "quantkit:api_key_tokens", "quantkit:api_key_tokens_total", key_name="dashboards") >= 4 * 16
    assert KEY not in httpx.get(server.url + "/metrics").text
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert value(server.url, "quantkit:requests_rejected", "quantkit:requests_rejected_total", reason="unauthorized") == 1
    assert value(server.url, "http_requests", "http_requests_total", handler="/v1/completions", status="200") >= 2
    labels = {s.labels.get("model_name") for s in fams["vllm:num_requests_running"].samples}
    assert labels == {"stories"}


def test_every_metric_the_dashboard_reads_is_in_a_live_scrape(server):
    traffic(server, n=1)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line[0] == "#"}
    for title, query in dashboard_queries():
        missing = metric_names(query) - exported
        assert not missing, f"Grafana panel {title!r} reads {missing}, absent from a live /metrics scrape"


def test_real_prometheus_scrapes_the_server(server, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian package `prometheus`; .ci/run installs it)")
    port = free_port()
    config = prometheus_config(tmp_path, [server.url.removeprefix("http://")], interval="1s")
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    stop = threading.Event()
    feeder = threading.Thread(target=lambda: [traffic(server, n=1, max_tokens=8) for _ in iter(stop.is_set, True)])
    feeder.start()
    api = f"http://127.0.0.1:{port}/api/v1/query"
    ttft = ("histogram_quantile(0.5, sum by (le) "
            "(rate(vllm:time_to_first_token_seconds_bucket{model_name=\"stories\"}[1m])))")
    try:
        deadline, rate, quantile = time.monotonic() + 60, [], []
        while time.monotonic() < deadline:
            try:
                answers = [httpx.get(api, params={"query": q}) for q in (
                    "rate(vllm:generation_tokens_total[1m]) > 0", ttft)]
            except httpx.TransportError:
                answers = []
            if not answers or any(a.status_code != 200 for a in answers):  # not up yet, or TSDB starting
                time.sleep(0.5)
                continue
            rate, quantile = (a.json() for a in answers)
            if rate["data"]["result"] and quantile["data"]["result"] \
                    and math.isfinite(float(quantile["data"]["result"][0]["value"][1])):
                break
            time.sleep(0.5)
        assert rate["data"]["result"], f"no generation rate after 60 s: {rate}"
        assert math.isfinite(float(quantile["data"]["result"][0]["value"][1])), quantile
        for title, query in dashboard_queries():  # every panel's query runs in Prometheus
            answer = httpx.get(api, params={"query": query}).json()
            assert answer["status"] == "success", (title, answer)
    finally:
        stop.set()
        feeder.join(60)
        prom.terminate()
        prom.wait(20)
        log.close()


def _success_total(url: str) -> float:
    return value(url, "vllm:request_success", "vllm:request_success_total")


def test_a_request_of_n_samples_counts_n_as_vllm_does(server):
    """vLLM counts each sample of a request as a finished request (measured on vLLM 0.32's CPU build: one
    completion with n=3 added 3 to vllm:request_success_total and 3 observations to the per-request histograms):
    so does the server, and the engine's own count stays equal to the sum (checked after the test)."""
    families = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:e2e_request_latency_seconds")
    before = {f: value(server.url, f, f + "_count") for f in families} | {"success": _success_total(server.url)}
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"prompt": "Once upon a time", "n": 3, "max_tokens": 8, "ignore_eos": True,
                         "temperature": 1.0, "seed": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3 * 8
    assert _success_total(server.url) - before["success"] == 3
    for f in families:
        assert value(server.url, f, f + "_count") - before[f] == 3, f
    engine = value(server.url, "quantkit:engine_finished_requests", "quantkit:engine_finished_requests_total")
    assert engine == _success_total(server.url)


def test_n_samples_left_mid_stream_count_n_aborts(server):
    """A client that leaves a stream of n=2 samples: both are aborted, and counted as two aborts."""
    aborts = value(server.url, "vllm:request_success", "vllm:request_success_total", finished_reason="abort")
    with server.paced(0.01), httpx.stream(
            "POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
            json={"prompt": "Once upon a time", "n": 2, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        assert sum(next(lines).startswith("data: ") for _ in range(6)) >= 3
    assert_quiescent(server)
    assert value(server.url, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") \
        - aborts == 2
