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


def test_bench_serve_refuses_lengths_past_the_servers_context(stories_dir):
    """Its default lengths (256 in + 128 out) on a server of 256 tokens' context: refused up front from
    /v1/models' max_model_len, one line, exit 2, before any prompt is sent."""
    from tests_support.live_server import stories_settings
    from tests_support.serving import serve_in_thread

    with serve_in_thread(stories_settings(stories_dir)) as server:
        before = server.state.llm.get_stats()
        code, output = run_cli("bench", "serve", "--base-url", server.url, "--num-prompts", "8")
        assert code == 2, output
        assert output.strip().splitlines() == [
            "error: --random-input-len 256 + --random-output-len 128 = 384 tokens, past the server's max_model_len "
            "of 256 (from /v1/models): every request would fail; lower them"]
        after = server.state.llm.get_stats()
        assert after.prompt_tokens == before.prompt_tokens and after.num_finished == before.num_finished


def test_bench_serve_fails_when_requests_fail_and_says_why(stories_server, tmp_path):
    """The shared server has no chat template: every chat request is a 400. The run exits 1, the distinct error is
    on the terminal (not only in the JSON), and latencies with no sample show as "-", never 0.00."""
    from typer.testing import CliRunner

    from quantkit.cli import build_app

    out = tmp_path / "bench.json"
    args = ["bench", "serve", "--base-url", stories_server.url, "--endpoint", "/v1/chat/completions",
            "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4", "--output", str(out)]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 1, result.output
    rep = json.loads(out.read_text())
    assert rep["successful_requests"] == 0 and rep["failed_requests"] == 4
    assert [e["count"] for e in rep["errors"]] == [4] and "no chat template" in rep["errors"][0]["message"]
    assert "4 of 4 requests failed" in result.stderr and "no chat template" in result.stderr
    ttft = next(line for line in result.stdout.splitlines() if "TTFT p50" in line)
    assert ttft.split("│")[2].strip() == "-" and "0.00" not in ttft
    allowed = CliRunner().invoke(build_app(), [*args[:-2], "--max-failed", "1"])
    assert allowed.exit_code == 0 and "no chat template" in allowed.stderr, allowed.output
