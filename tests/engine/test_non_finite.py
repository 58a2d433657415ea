"""A checkpoint whose numbers are not finite: `generate` (and `serve`, same loader) refuse 4-bit scales that hold
NaN or inf, in one line naming the layer; and logits that come out non-finite at run time fail their request
with an error, never turn into text (greedy sampling of NaN logits picks token 0 every time)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import build_app
from quantkit.engine import LLM, SamplingParams
from quantkit.engine.llm_engine import non_finite_rows
from tests_support.corrupt import corrupt, nan_every_seventh

BAD_SCALES = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def rtn(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("rtn") / "q"
    done = CliRunner().invoke(build_app(), ["quantize", str(tiny_llama), "--method", "rtn", "--group-size", "32",
                                            "--out", str(out)])
    assert done.exit_code == 0, done.output
    return out


def test_generate_refuses_non_finite_scales_in_one_line(rtn, tmp_path):
    bad = corrupt(rtn, tmp_path / "bad", f"{BAD_SCALES}.scales", nan_every_seventh)
    done = CliRunner().invoke(build_app(), ["generate", str(bad), "--prompt", "Once upon a time", "--max-tokens", "8",
                                            "--threads", "1"])
    assert done.exit_code == 2, done.output
    assert done.stdout == ""  # no text
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{BAD_SCALES}.scales" in errors[0] and "NaN or inf" in errors[0], done.stderr
    assert "Traceback" not in done.output


def test_non_finite_logits_fail_the_request_never_text(tiny_llama, tmp_path):
    """Finite scales, but a float weight that makes every logit NaN (the final norm's): each request fails with
    finish_reason "error" and an error saying why, and no token is handed out as text."""
    bad = corrupt(tiny_llama, tmp_path / "nan-norm", "model.norm.weight", nan_every_seventh)
    llm = LLM(str(bad), max_model_len=128, dtype="float32", num_threads=1)
    outs = llm.generate(["Once upon a time", "The dog"], SamplingParams(temperature=0, max_tokens=8))
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "error" and c.token_ids == [] and c.text == ""
        assert "non-finite logits" in out.error
    done = CliRunner().invoke(build_app(), ["generate", str(bad), "--prompt", "Once upon a time", "--max-tokens", "8",
                                            "--threads", "1", "--dtype", "float32"])
    assert done.exit_code == 2 and done.stdout == "" and "non-finite logits" in done.stderr, done.output


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rows_finds_each_kind_in_any_row(bad):
    logits = torch.randn(5, 1000)
    logits[1, 7] = bad
    logits[4, 999] = bad
    assert non_finite_rows(logits) == [1, 4]


def test_non_finite_rows_keeps_rows_whose_sum_overflows_but_whose_logits_are_finite():
    logits = torch.randn(3, 64)
    logits[2] = 3e37  # finite logits whose row sum is inf in fp32: the cheap test misses, the exact one keeps it
    assert not torch.isfinite(logits[2].sum())
    assert non_finite_rows(logits) == []
    logits[0, 0] = float("nan")
    assert non_finite_rows(logits) == [0]
