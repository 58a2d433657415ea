"""`quantkit generate` on the engine: --prompt, --prompts-file (lines or JSONL), --output JSONL, errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from quantkit.cli import build_app
from quantkit.commands.generate import parse_size, read_prompts
from quantkit.errors import QuantkitError


@pytest.fixture(scope="module")
def app():
    return build_app()


def run(app, *args):
    return CliRunner().invoke(app, ["generate", *map(str, args)])


def test_prompts_file_to_jsonl_matches_the_python_api(app, stories_dir, tmp_path):
    from quantkit.engine import LLM, SamplingParams

    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\n\nThe little dog\n" + "word " * 300 + "\n")
    out = tmp_path / "out.jsonl"
    res = run(app, stories_dir, "--prompts-file", prompts, "--max-tokens", 12, "--temperature", 0,
              "--max-model-len", 128, "--output", out, "--threads", 1)
    assert res.exit_code == 1, res.output  # the others ran; the exit status says one failed
    assert "1 of 3 prompts failed" in res.output
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["Once upon a time", "The little dog", "word " * 300]
    want = LLM(str(stories_dir), max_model_len=128).generate(["Once upon a time", "The little dog"],
                                                             SamplingParams(temperature=0, max_tokens=12))
    for row, w in zip(rows, want):
        assert row["token_ids"] == w.outputs[0].token_ids and row["text"] == w.outputs[0].text
        assert row["finish_reason"] == "length"
    assert rows[2]["finish_reason"] == "error" and "more than max_model_len 128" in rows[2]["error"]
    assert "KV cache:" in res.output and not list(tmp_path.glob(".out.jsonl.tmp-*"))
    assert "weights: " in res.output and "resident" in res.output  # the start-up weight memory line


def test_single_prompt_prints_the_completion(app, stories_dir):
    res = run(app, stories_dir, "--prompt", "Once upon a time", "--max-tokens", 8, "--threads", 1)
    assert res.exit_code == 0, res.output
    assert ", there was a little girl" in res.stdout


def test_prompt_and_file_are_exclusive_and_errors_are_one_line(app, stories_dir, tmp_path):
    res = run(app, stories_dir)
    assert res.exit_code == 2 and "exactly one of --prompt or --prompts-file" in res.output
    res = run(app, stories_dir, "--prompt", "x", "--top-p", 0)
    assert res.exit_code == 2 and "top_p must be in (0, 1]" in res.output and "Traceback" not in res.output


def test_read_prompts_accepts_jsonl_and_rejects_bad_rows(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a"}\n{"prompt": "b c", "id": 3}\n')
    assert read_prompts(good) == ["a", "b c"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(QuantkitError, match=r"bad.jsonl:2: expected an object"):
        read_prompts(bad)
    empty = tmp_path / "e.txt"
    empty.write_text("\n\n")
    with pytest.raises(QuantkitError, match="no prompts"):
        read_prompts(empty)


def test_parse_size():
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("2G") == 2 * 1024**3
    assert parse_size("1000") == 1000
    with pytest.raises(QuantkitError):
        parse_size("lots")


def test_a_single_prompt_longer_than_the_context_is_a_one_line_error(app, stories_dir, transformers_warnings):
    res = run(app, stories_dir, "--prompt", "word " * 600, "--max-tokens", 4, "--threads", 1)
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and "more than max_model_len 512" in res.output and "Traceback" not in res.output
    assert not [r for r in transformers_warnings if "indexing errors" in r.getMessage()]


def test_llm_generate_gives_a_per_request_error(stories_dir, transformers_warnings):
    from quantkit.engine import LLM, SamplingParams

    outs = LLM(str(stories_dir), max_model_len=64).generate(["Once upon a time", "word " * 600],
                                                            SamplingParams(temperature=0, max_tokens=4))
    assert outs[0].error is None and outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "error" and "more than max_model_len 64" in outs[1].error
    assert not [r for r in transformers_warnings if "indexing errors" in r.getMessage()]


def test_stopping_at_the_context_limit_is_said(app, stories_dir, tmp_path):
    from quantkit.engine import LLM, SamplingParams
    from quantkit.engine.llm import context_limit_note

    prompt = "Once upon a time " * 14  # 57 tokens: 64 - 57 < --max-tokens 40
    out = tmp_path / "out.jsonl"
    prompts = tmp_path / "p.txt"
    prompts.write_text(prompt + "\nOnce upon a time\n")
    res = run(app, stories_dir, "--prompts-file", prompts, "--max-tokens", 40, "--max-model-len", 64,
              "--output", out, "--threads", 1, "--temperature", 0)
    assert res.exit_code == 0, res.output
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert rows[0]["finish_reason"] == "length" and len(rows[0]["token_ids"]) < 40
    assert "context limit" in rows[0]["note"] and "max_model_len 64" in rows[0]["note"]
    assert "note" not in rows[1] or "context limit" not in rows[1]["note"]
    assert "context limit" in res.output
    # the same from the Python API
    llm = LLM(str(stories_dir), max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first, second = llm.generate([prompt, "Once upon a time"], params)
    assert "context limit" in context_limit_note(first, params, llm.engine.max_model_len)
    assert context_limit_note(second, params, llm.engine.max_model_len) is None


def test_cpu_int8_flags_reach_the_engine_config(app, stories_dir, monkeypatch):
    from quantkit.engine import llm as llm_module

    seen = []
    real = llm_module.EngineConfig

    def recording(**kwargs):
        seen.append(real(**kwargs))
        return seen[-1]

    monkeypatch.setattr(llm_module, "EngineConfig", recording)
    for flag, field, want in (("--cpu-int8-activations", "cpu_int8_activations", True),
                              ("--no-cpu-int8-activations", "cpu_int8_activations", False),
                              ("--cpu-int8-lm-head", "cpu_int8_lm_head", True),
                              ("--no-cpu-int8-lm-head", "cpu_int8_lm_head", False),
                              ("--cpu-int8-prefill", "cpu_int8_prefill", True),
                              ("--no-cpu-int8-prefill", "cpu_int8_prefill", False)):
        res = run(app, stories_dir, "--prompt", "Once upon a time", "--max-tokens", 2, "--threads", 1, flag)
        assert res.exit_code == 0, res.output
        assert getattr(seen[-1], field) is want


def test_json_schema_and_regex_flags_hold_every_output(app, stories_dir, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\nThe little dog\n")
    out = tmp_path / "out.jsonl"
    res = run(app, stories_dir, "--prompts-file", prompts, "--json-schema", schema, "--output", out)
    assert res.exit_code == 0, res.output
    assert [json.loads(json.loads(row)["text"]) in ({"ok": True}, {"ok": False}) for row in out.read_text().splitlines()] \
        == [True, True]
    res = run(app, stories_dir, "--prompt", "Once", "--regex", "[0-9]{4}")
    assert res.exit_code == 0 and res.output.strip().splitlines()[-1].isdigit(), res.output


@pytest.mark.parametrize("args,words", [(["--regex", "[0-9"], "regex does not compile"),
                                        (["--regex", "a", "--json-schema", "x.json"], "at most one")])
def test_a_bad_structured_output_flag_is_one_line(app, stories_dir, args, words):
    res = run(app, stories_dir, "--prompt", "Once", *args)
    assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output


def test_speculative_config_flag(app, stories_dir):
    args = ["--prompt", "Tom had a big red ball. Tom had a big red ball. Tom had", "--max-tokens", 20, "--dtype", "float32"]
    plain = run(app, stories_dir, *args)
    spec = run(app, stories_dir, *args, "--speculative-config", '{"num_speculative_tokens": 3}')
    assert plain.exit_code == spec.exit_code == 0
    assert plain.output.strip().splitlines()[-1] == spec.output.strip().splitlines()[-1]
    for bad, words in (("{nope", "not JSON"), ('{"num_speculative_tokens": 2, "method": "eagle"}', "not supported")):
        res = run(app, stories_dir, *args, "--speculative-config", bad)
        assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output
