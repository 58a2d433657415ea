"""The README's main job: `quantkit demo` runs offline end to end (here with a short training run)."""

import pytest

from tests_support.cli import run_cli


@pytest.mark.slow
def test_demo_runs_offline_and_reports_perplexity(tmp_path):
    code, output = run_cli("demo", "--workdir", tmp_path, "--train-steps", "20")
    assert code == 0, output
    assert "trained the demo model: 20 steps" in output
    for row in ("float32", "rtn int4 g128", "gptq int4 g128", "GPTQ INT4 sample"):
        assert row in output
    assert (tmp_path / "gptq" / "model.safetensors").is_file()
    code, output = run_cli("demo", "--workdir", tmp_path, "--train-steps", "20")
    assert code == 0 and "using the cached demo model" in output



# The demo's output, step by step: only our own rich bars, each with a count; nothing from below.
NOISE = ("Writing model shards", "it/s]", "0/?")


def test_training_step_prints_only_our_bar(tmp_path, capsys, monkeypatch):
    from quantkit.demo import DemoSpec, train_demo_model

    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # as a user's shell has it
    train_demo_model(tmp_path / "m", DemoSpec(train_steps=2, train_stories=60, batch=2, seqlen=32))
    err = capsys.readouterr().err
    assert not [n for n in NOISE if n in err], err
    assert "train demo model" in err and "2/2" in err


def test_quantize_step_counts_its_calibration_windows(tiny_llama, tmp_path, capsys):
    from quantkit.calibration.synthetic import make_corpus
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.quant.pipeline import quantize_model

    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(make_corpus(100, seed=1)))
    out = tmp_path / "q"
    out.mkdir()
    cfg = QuantizeConfig(model=str(tiny_llama), out=out, method="gptq", group_size=64,
                         calib=CalibConfig(source=str(calib), nsamples=4, seqlen=32))
    quantize_model(cfg, out)
    err = capsys.readouterr().err
    assert not [n for n in NOISE if n in err], err
    line = next(ln for ln in err.splitlines() if ln.startswith("calibration windows"))
    assert "4/4" in line


def test_report_step_tokenizes_long_text_without_a_warning(stories_dir, transformers_warnings):
    from quantkit.eval.perplexity import tokenize_once
    from quantkit.model.loader import load_tokenizer

    ids, _ = tokenize_once(load_tokenizer(stories_dir), "Once upon a time " * 400)  # > model_max_length 512
    assert ids.numel() > 512
    assert not [r for r in transformers_warnings if "sequence length" in r.getMessage()]
