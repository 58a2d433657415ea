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
