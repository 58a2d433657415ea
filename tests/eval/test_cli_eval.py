"""`quantkit eval` end to end on tiny models: the report, the JSON, the gate's exit codes, bad input."""

import json

import pytest
import typer
from typer.testing import CliRunner

from quantkit.commands import eval as eval_cmd

TEXT = " ".join(f"story {i}: the little cat sat on the warm mat and looked at the big dog." for i in range(80))


def app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)
    app.callback()(lambda: None)
    eval_cmd.register(app)
    return app


def invoke(*args):
    return CliRunner().invoke(app(), ["eval", *map(str, args)])


@pytest.fixture(scope="module")
def tiny_rtn(tiny_llama, tmp_path_factory):
    from quantkit.config import QuantizeConfig
    from quantkit.quant.pipeline import quantize_model

    out = tmp_path_factory.mktemp("tiny-rtn") / "q"
    out.mkdir()
    quantize_model(QuantizeConfig(model=str(tiny_llama), out=out, method="rtn", group_size=64), out, show_progress=False)
    from quantkit.model.loader import load_tokenizer

    load_tokenizer(tiny_llama).save_pretrained(out)  # in case the writer leaves the tokenizer out
    return out


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def common(tiny_llama, tmp_path, text_file, mmlu_dir):
    return ["--base", tiny_llama, "--mmlu-dir", mmlu_dir, "--subjects", "anatomy,marketing", "--limit", 2,
            "--num-fewshot", 0, "--ppl-text", text_file, "--seqlen", 64, "--cache-dir", tmp_path / "cache",
            "--threads", 1]


@pytest.mark.slow
def test_report_json_and_gates(tiny_llama, tiny_rtn, tmp_path, text_file, mmlu_dir):
    out = tmp_path / "report.json"
    result = invoke(tiny_rtn, *common(tiny_llama, tmp_path, text_file, mmlu_dir), "--output", out)
    assert result.exit_code == 0, result.output
    assert "MMLU (all)" in result.stdout and "perplexity" in result.stdout
    assert "36 of 38 subjects skipped" in result.stderr and "at most 2 questions per subject" in result.stderr
    data = json.loads(out.read_text())
    assert {"base", "quantized", "delta", "settings"} <= data.keys()
    for key in ("base", "quantized"):
        assert {"mmlu_acc", "mmlu_acc_stem", "mmlu_acc_other", "ppl"} <= data[key].keys()
    assert data["delta"]["ppl_ratio"] == pytest.approx(data["quantized"]["ppl"] / data["base"]["ppl"])
    assert data["runtime"]["quantized"]["quantization"].startswith("rtn") or "gptq" in \
        data["runtime"]["quantized"]["quantization"]
    assert data["runtime"]["base"]["cached_tasks"] == []
    ratio, drop = data["delta"]["ppl_ratio"], -100 * data["delta"]["mmlu_acc"]

    # second run: the base comes from the cache; gates decide the exit code
    passing = invoke(tiny_rtn, *common(tiny_llama, tmp_path, text_file, mmlu_dir), "--max-ppl-ratio", ratio * 1.01,
                     "--max-drop", drop + 1)
    assert passing.exit_code == 0, passing.output
    assert "from the cache" in passing.stderr
    failing = invoke(tiny_rtn, *common(tiny_llama, tmp_path, text_file, mmlu_dir), "--max-ppl-ratio", ratio * 0.99)
    assert failing.exit_code == 1 and "gate failed: perplexity ratio" in failing.stderr
    failing = invoke(tiny_rtn, *common(tiny_llama, tmp_path, text_file, mmlu_dir), "--max-drop", drop - 1)
    assert failing.exit_code == 1 and "gate failed: MMLU dropped" in failing.stderr


@pytest.mark.parametrize("extra, message", [
    (["--tasks", "mmlu,hellaswag"], "unknown task hellaswag"),
    (["--subjects", "astrology"], "astrology not available"),
    (["--dtype", "float16", "--device", "cpu"], "fp16 matmul"),
    (["--num-fewshot", "-1"], "--num-fewshot must be 0 or more"),
    (["--cpu-int8-lm-head", "--dtype", "float16"], "needs --device cpu and --dtype bfloat16 or float32"),
])
def test_bad_input_is_one_line(tiny_llama, tmp_path, text_file, mmlu_dir, extra, message):
    result = invoke(tiny_llama, *common(tiny_llama, tmp_path, text_file, mmlu_dir), "--allow-unquantized", *extra)
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_malformed_mmlu_names_file_and_row(tiny_llama, tmp_path, text_file):
    for split in ("test", "dev"):
        (tmp_path / "m" / split).mkdir(parents=True)
        (tmp_path / "m" / split / f"anatomy_{split}.csv").write_text("q,a,b,c,d,A\nq2,a,b,c,d,7\n")
    result = invoke(tiny_llama, "--base", tiny_llama, "--tasks", "mmlu", "--mmlu-dir", tmp_path / "m",
                    "--allow-unquantized")
    assert result.exit_code == 2
    assert "anatomy_dev.csv: row 2: answer '7' is not one of A, B, C, D" in result.stderr \
        or "anatomy_test.csv: row 2: answer '7'" in result.stderr


def test_hub_mmlu_offline_is_one_line(tiny_llama, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = invoke(tiny_llama, "--base", tiny_llama, "--tasks", "mmlu", "--allow-unquantized")
    assert result.exit_code == 2 and "pass --mmlu-dir DIR" in result.stderr


def test_text_shorter_than_a_window(tiny_llama, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("a cat")
    result = invoke(tiny_llama, "--base", tiny_llama, "--tasks", "ppl", "--ppl-text", short, "--seqlen", 64,
                    "--no-cache", "--threads", 1, "--allow-unquantized")
    assert result.exit_code == 2 and "fewer than one window of --seqlen 64" in result.stderr


def test_tokenizer_mismatch_warns_when_allowed(tiny_llama, stories_dir, tmp_path, text_file):
    result = invoke(tiny_llama, "--base", stories_dir, "--tasks", "ppl", "--ppl-text", text_file, "--seqlen", 64,
                    "--no-cache", "--threads", 1, "--allow-unquantized", "--allow-mismatched-base")
    assert result.exit_code == 0, result.output
    assert "warning:" in result.stderr and "--allow-mismatched-base" in result.stderr
    assert "the vocabularies differ" in result.stderr


@pytest.fixture(scope="module")
def other_tiny_llama(tmp_path_factory):
    """tiny_llama's config and tokenizer, other weights (seed 1): a different model of the same shape."""
    from tests_support.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-seed1") / "m", seed=1)


@pytest.mark.parametrize("base, says", [
    ("stories_dir", "hidden_size 128 vs 64"),  # another shape (and tokenizer)
    ("other_tiny_llama", "source_fingerprint"),  # same shape and tokenizer, other weights
])
def test_a_base_it_was_not_quantized_from_is_refused(tiny_rtn, text_file, request, base, says):
    """QUANTIZED was made from tiny_llama: a --base that is another model would give a meaningless ratio (a
    perplexity ratio of 0.06 in the report that found this); refused in one line, unless allowed."""
    base_dir = request.getfixturevalue(base)
    result = invoke(tiny_rtn, *ppl_args(base_dir, text_file, "--seqlen", 64))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output
    assert f"{tiny_rtn} was not quantized from {base_dir}" in lines[0] and says in lines[0], lines[0]
    assert "--allow-mismatched-base" in lines[0]
    allowed = invoke(tiny_rtn, *ppl_args(base_dir, text_file, "--seqlen", 64, "--allow-mismatched-base"))
    assert allowed.exit_code == 0, allowed.output
    assert "warning:" in allowed.stderr and says in allowed.stderr


def ppl_args(base, text_file, *extra):
    return ["--base", base, "--tasks", "ppl", "--ppl-text", text_file, "--no-cache", "--threads", 1, *extra]


def test_a_float_quantized_folder_is_refused(tiny_llama, text_file):
    result = invoke(tiny_llama, *ppl_args(tiny_llama, text_file, "--seqlen", 64))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "not quantized" in result.stderr and "--allow-unquantized" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_allow_unquantized_runs_and_the_report_says_so(tiny_llama, text_file, tmp_path):
    out = tmp_path / "report.json"
    result = invoke(tiny_llama, *ppl_args(tiny_llama, text_file, "--seqlen", 64, "--allow-unquantized",
                                          "--output", out))
    assert result.exit_code == 0, result.output
    assert "not quantized" in result.stdout
    assert json.loads(out.read_text())["settings"]["quantized_checkpoint"] == "not quantized"


def test_the_report_says_what_the_quantized_checkpoint_is(tiny_llama, tiny_rtn, text_file, tmp_path):
    out = tmp_path / "report.json"
    result = invoke(tiny_rtn, *ppl_args(tiny_llama, text_file, "--seqlen", 64, "--output", out))
    assert result.exit_code == 0, result.output
    what = json.loads(out.read_text())["settings"]["quantized_checkpoint"]
    assert "gptq" in what and "4-bit" in what and "group size 64" in what
    assert "group size 64" in result.stdout


def test_ppl_limit_scores_the_first_windows(tiny_llama, tiny_rtn, text_file, tmp_path):
    """`--tasks ppl --limit N` (as lm-eval's --limit): both models over the first N windows, said in the report."""
    out = tmp_path / "report.json"
    result = invoke(tiny_rtn, *ppl_args(tiny_llama, text_file, "--seqlen", 64, "--limit", 2, "--output", out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    for role in ("base", "quantized"):
        assert "the first 2 of" in data["runtime"][role]["ppl_protocol"], data["runtime"][role]
    assert data["settings"]["limit"] == 2
    assert "perplexity: at most the first 2 windows (--limit)" in result.stderr
    whole = invoke(tiny_rtn, *ppl_args(tiny_llama, text_file, "--seqlen", 64, "--output", tmp_path / "all.json"))
    assert whole.exit_code == 0, whole.output
    assert json.loads((tmp_path / "all.json").read_text())["base"]["ppl"] != data["base"]["ppl"]


def test_ppl_seqlen_is_clipped_to_the_context_and_the_report_says_so(tiny_llama, tiny_rtn, tmp_path):
    long_text = tmp_path / "long.txt"
    long_text.write_text(TEXT * 4)  # a few 512-token windows of the tiny model
    out = tmp_path / "report.json"
    result = invoke(tiny_rtn, *ppl_args(tiny_llama, long_text, "--output", out))  # default --seqlen 2048
    assert result.exit_code == 0, result.output
    settings = json.loads(out.read_text())["settings"]
    assert settings["seqlen"] == 512 and settings["seqlen_requested"] == 2048
    assert "--seqlen 2048 clipped to the models' context of 512 tokens" in result.stderr


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cpu_int8_lm_head_evaluates_the_engines_head(tiny_llama, tiny_rtn, text_file, tmp_path, dtype):
    """--cpu-int8-lm-head: the quantized model's float head in int8 (what `serve --cpu-int8-lm-head` runs), the
    base as it is; the perplexity moves by the head's rounding only."""
    import torch

    from quantkit.kernels.int8_cpu import int8_head_unavailable

    if (why := int8_head_unavailable(torch.device("cpu"), getattr(torch, dtype))) is not None:
        pytest.skip(why)
    reports = {}
    for flag in ((), ("--cpu-int8-lm-head",)):
        out = tmp_path / f"report{len(flag)}.json"
        result = invoke(tiny_rtn, *ppl_args(tiny_llama, text_file, "--seqlen", 64, "--dtype", dtype,
                                            "--output", out, *flag))
        assert result.exit_code == 0, result.output
        reports[bool(flag)] = json.loads(out.read_text())
    on, off = reports[True], reports[False]
    assert on["settings"]["cpu_int8_lm_head"] is True and off["settings"]["cpu_int8_lm_head"] is False
    assert on["runtime"]["quantized"]["quantization"].endswith("lm_head held in int8 (--cpu-int8-lm-head)")
    assert "int8" not in off["runtime"]["quantized"]["quantization"]
    assert "int8" not in on["runtime"]["base"]["quantization"] and on["base"]["ppl"] == off["base"]["ppl"]
    q_on, q_off = on["quantized"]["ppl"], off["quantized"]["ppl"]
    assert q_on != q_off and abs(q_on / q_off - 1) < 0.02


def test_only_our_bars_show(tiny_llama, tiny_rtn, tmp_path, mmlu_dir):
    """lm-eval's tqdm bars (it builds each task's contexts under one) stay out of the output even in a process
    where tqdm was imported before the command ran (torch imports it): our rich bars are the only ones."""
    import sys

    assert "tqdm" in sys.modules
    result = invoke(tiny_rtn, "--base", tiny_llama, "--tasks", "mmlu", "--mmlu-dir", mmlu_dir, "--subjects",
                    "anatomy", "--limit", 2, "--num-fewshot", 0, "--no-cache", "--threads", 1)
    assert result.exit_code == 0, result.output
    assert "it/s]" not in result.output and "%|" not in result.output, result.output
    assert "base: MMLU" in result.stderr and "quantized: MMLU" in result.stderr
