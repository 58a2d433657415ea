"""`quantkit serve` flags: bad values are one-line errors before anything starts."""

from __future__ import annotations

import pytest

from tests_support.cli import run_cli


@pytest.mark.parametrize("args, words", [
    (("--port", "70000"), "--port"),
    (("--max-queued-requests", "0"), "--max-queued-requests"),
    (("--shutdown-timeout", "-1"), "--shutdown-timeout"),
    (("--chat-template", "/nonexistent/t.jinja"), "--chat-template"),
    (("--max-num-seqs", "0"), "max_num_seqs"),
    (("--dtype", "int3"), "dtype"),
    (("--log-level", "loud"), "--log-level"),
    (("--tool-call-parser", "nope"), "hermes, llama3_json, mistral"),
    (("--enable-auto-tool-choice",), "--tool-call-parser"),
    (("--pooling", "cls"), "--pooling"),
    (("--allowed-origins", "https://a.example"), "--allowed-origins: not JSON"),
    (("--allowed-methods", '{"a": 1}'), "--allowed-methods: expected a JSON list"),
    (("--root-path", "llm/"), "--root-path"),
    (("--max-logprobs", "-2"), "max_logprobs"),
    (("--speculative-config", '{"method": "eagle"}'), "speculative decoding"),
    (("--speculative-config", "ngram"), "--speculative-config: not JSON"),
])
def test_bad_flags_are_one_line_errors(args, words):
    code, output = run_cli("serve", "some-model", *args)
    assert code == 2 and "error:" in output and words in output
    assert "Traceback" not in output


def test_help_lists_vllms_flag_names(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich would cut long flag names at 80 columns
    code, output = run_cli("serve", "--help")
    assert code == 0
    for flag in ("--served-model-name", "--api-key", "--max-model-len", "--max-num-batched-tokens",
                 "--gpu-memory-utilization", "--enable-prefix-caching", "--max-queued-requests", "--chat-template",
                 "--enable-auto-tool-choice", "--tool-call-parser",
                 "--seed", "--tokenizer", "--max-logprobs", "--allowed-origins", "--allowed-methods", "--allowed-headers",
                 "--allow-credentials", "--root-path", "--uds", "--speculative-config", "--pooling"):
        assert flag in output


def test_a_missing_model_path_is_one_line_before_the_server_starts(tmp_path):
    """A real `quantkit serve` process on a path that does not exist: exit 2 with one line, no traceback, and no
    server started (nothing from uvicorn), within seconds rather than after loading torch's kernels."""
    from tests_support.serving import serve_until_it_exits

    missing = tmp_path / "no-such-model"
    code, output = serve_until_it_exits(missing, timeout=120)
    assert code == 2, output
    assert output.strip() == f"error: {missing}: no such folder", output


def test_the_typed_flags_build_the_settings():
    """serve_settings, the flag handling: ServeFlags' defaults are the command line's, and each flag lands in its
    ServeSettings / EngineConfig field."""
    from quantkit.commands.serve import ServeFlags, serve_settings

    settings = serve_settings(ServeFlags(model="m", served_model_name=["a", "b"], kv_cache_memory="512MiB", seed=3,
                                         allowed_origins='["https://a.example"]', max_num_seqs=8))
    assert settings.served_model_names == ("a", "b") and settings.port == 8000 and settings.pooling == "last"
    assert settings.allowed_origins == ("https://a.example",) and settings.allowed_methods == ("*",)
    engine = settings.engine
    assert (engine.model, engine.max_num_seqs, engine.kv_cache_memory, engine.seed) == ("m", 8, 512 * 2**20, 3)
    assert engine.enable_prefix_caching and engine.block_size == 16
