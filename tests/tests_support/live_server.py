"""Reading a live `quantkit serve` from outside, for the production tests: its /metrics, and the checks
every such test ends with (nothing in flight, no KV block held, consistent counters)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests_support.serving import settings_for

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "data" / "stories260K-hf"
# stories260K has no chat template: a one-line one, so the chat endpoint (and the chat page) work.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")

# Every family /metrics carries, with its type (prometheus-client's family names: counters without _total).
FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:iteration_tokens_total": "histogram",
    "quantkit:num_requests_swapped": "gauge", "quantkit:swap_blocks_in_use": "gauge",
    "quantkit:requests_rejected": "counter", "quantkit:model_weights_bytes": "gauge",
    "quantkit:api_key_requests": "counter", "quantkit:api_key_tokens": "counter",
    "http_requests": "counter", "http_request_duration_seconds": "histogram",
}


def stories_settings(stories_dir, **kw):
    """Settings for a small stories260K server (served as "stories", max_model_len 256, 8 MiB of KV)."""
    kw.setdefault("served_model_names", ("stories",))
    kw.setdefault("chat_template", CHAT_TEMPLATE)
    return settings_for(stories_dir, **{"max_model_len": 256, "kv_cache_memory": 8 << 20, **kw})


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(url: str, family: str, sample: str | None = None, **labels) -> float:
    """A sample's value, summed over the label sets that match `labels`."""
    return sum(s.value for s in scrape(url)[family].samples
               if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items()))


def assert_quiescent(running, timeout: float = 15.0) -> None:
    """Nothing in flight, every KV block back in the free pool (the engine's own pool, when the server runs
    in this process; `running` may also be just a URL), and the server's finished requests by reason
    summing to the engine's count."""
    deadline = time.monotonic() + timeout
    url = running if isinstance(running, str) else running.url
    while True:
        fams = scrape(url)
        got = {name: _one(fams, name) for name in
               ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
        served = sum(s.value for s in fams["vllm:request_success"].samples if s.name.endswith("_total"))
        engine = _one(fams, "quantkit:engine_finished_requests", "quantkit:engine_finished_requests_total")
        leaked = running.engine.kv_plan.num_blocks - running.free_blocks() if hasattr(running, "engine") else 0
        if not any(got.values()) and served == engine and leaked == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not quiescent after {timeout} s: {got}, {leaked} KV blocks held, "
                                 f"request_success_total {served} vs engine finished {engine}")
        time.sleep(0.1)


def _one(fams: dict, family: str, sample: str | None = None) -> float:
    return next(s.value for s in fams[family].samples if s.name == (sample or family))

