"""What GPTQ's layer loop holds while it solves (quantkit.quant.gptq_layer): each Hessian is let go as soon as its
linears are solved, so a layer's largest solve (down_proj's, the last) has no other group's Hessian beside it."""

from __future__ import annotations

import weakref

import pytest
import torch

from quantkit.config import CalibConfig, QuantizeConfig
from quantkit.format.primitives import QuantizedWeight
from quantkit.quant import gptq_layer, pipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    from quantkit.calibration.synthetic import make_corpus

    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n\n".join(make_corpus(64, seed=1)))
    return path


@pytest.mark.parametrize("true_sequential", [False, True])
def test_each_solve_holds_its_own_hessian_and_none_past_it(tiny_llama, calib, tmp_path, monkeypatch, true_sequential):
    made: list[weakref.ref] = []
    empty_hessian = gptq_layer.empty_hessian

    def spy_empty_hessian(*args, **kwargs):
        h = empty_hessian(*args, **kwargs)
        made.append(weakref.ref(h))
        return h

    alive_at_solves: list[int] = []
    gptq_quantize = gptq_layer.gptq_quantize

    def spy_gptq_quantize(w, h, *args, **kwargs):
        alive_at_solves.append(sum(ref() is not None for ref in made))
        return gptq_quantize(w, h, *args, **kwargs)

    alive_at_dequantize: list[int] = []
    dequantize = QuantizedWeight.dequantize

    def spy_dequantize(qw):
        alive_at_dequantize.append(sum(ref() is not None for ref in made))
        return dequantize(qw)

    monkeypatch.setattr(QuantizedWeight, "dequantize", spy_dequantize)
    monkeypatch.setattr(gptq_layer, "empty_hessian", spy_empty_hessian)
    monkeypatch.setattr(gptq_layer, "gptq_quantize", spy_gptq_quantize)
    out = tmp_path / "out"
    out.mkdir()
    cfg = QuantizeConfig(model=str(tiny_llama), out=out, method="gptq", bits=4, group_size=32,
                         true_sequential=true_sequential, calib=CalibConfig(source=str(calib), nsamples=4, seqlen=64),
                         device="cpu")
    pipeline.quantize_model(cfg, out_dir=out, show_progress=False)
    # per layer: q/k/v stacked, o, gate/up stacked, down. One float run of the layer makes all four Hessians, and
    # each solve holds its own and those of the solves still to come; true-sequential makes each on its turn
    assert alive_at_solves == ([1] * 8 if true_sequential else [4, 3, 2, 1] * 2)
    # and a solve's own Hessian is gone before its weights are dequantized back into the layer (q, k, v, o, gate, up,
    # down); true-sequential collects the next group's after
    assert alive_at_dequantize == ([0] * 14 if true_sequential else [3, 3, 3, 2, 1, 1, 0] * 2)
