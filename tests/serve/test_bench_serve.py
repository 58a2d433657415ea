"""`quantkit bench serve` against the test server: its token counts equal the server's usage."""

from __future__ import annotations

import json

from tests_support.cli import run_cli


def test_bench_serve_counts_equal_the_servers(stories_server, tmp_path):
    before = stories_server.state.llm.get_stats()
    out = tmp_path / "bench.json"
    code, output = run_cli("bench", "serve", "--base-url", stories_server.url, "--num-prompts", "12",
                           "--max-concurrency", "4", "--request-rate", "50", "--random-input-len", "24",
                           "--random-output-len", "8", "--ignore-eos", "--output", out)
    assert code == 0, output
    rep = json.loads(out.read_text())
    stories_server.wait_idle()
    after = stories_server.state.llm.get_stats()
    assert rep["successful_requests"] == 12 and rep["failed_requests"] == 0
    assert rep["total_input_tokens"] == 12 * 24 == after.prompt_tokens - before.prompt_tokens
    assert rep["total_output_tokens"] == 12 * 8 == after.generation_tokens - before.generation_tokens
    assert rep["ttft_ms"]["p50"] > 0 and rep["itl_ms"]["p99"] >= rep["itl_ms"]["p50"] > 0
    assert rep["output_throughput"] > 0 and "TTFT p99" in output


def test_bench_serve_unreachable_server_is_a_one_line_error():
    code, output = run_cli("bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1")
    assert code == 2 and "error:" in output
