"""What GPTQ's layer loop holds while it solves (quantkit.quant.gptq_layer): each Hessian is let go as soon as its
linears are solved, and the linears solved so far wait as integer weights, so a layer's largest solve (down_proj's,
the last) has neither another group's Hessian nor the other linears' fp32 weights beside it."""

from __future__ import annotations

import weakref

import pytest
import torch

from quantkit.config import CalibConfig, QuantizeConfig
from quantkit.format.arch import get_submodule
from quantkit.quant import gptq_layer, pipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LINEARS = [f"self_attn.{n}_proj" for n in "qkvo"] + [f"mlp.{n}_proj" for n in ("gate", "up", "down")]


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

    empty_at_solves: list[list[str]] = []  # the layer's linears holding no weight at each solve

    def spy_gptq_quantize(w, h, *args, **kwargs):
        alive_at_solves.append(sum(ref() is not None for ref in made))
        empty_at_solves.append([n for n in LINEARS if get_submodule(layers[-1], n).weight.numel() == 0])
        return gptq_quantize(w, h, *args, **kwargs)

    layers = []
    quantize_layer = gptq_layer.GPTQMethod.quantize_layer

    def spy_quantize_layer(self, ctx):
        layers.append(ctx.layer)
        out = quantize_layer(self, ctx)
        for name, qw in out.weights.items():  # the method's contract: dequantized weights back in the layer
            assert torch.equal(get_submodule(ctx.layer, name).weight.data, qw.dequantize())
        return out

    monkeypatch.setattr(gptq_layer.GPTQMethod, "quantize_layer", spy_quantize_layer)
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
    # the linears being solved and (until the layer runs again) those solved before hold no fp32 weight meanwhile
    if true_sequential:
        assert empty_at_solves == [LINEARS[:3], LINEARS[3:4], LINEARS[4:6], LINEARS[6:]] * 2
    else:
        assert empty_at_solves == [LINEARS[:3], LINEARS[:4], LINEARS[:6], LINEARS] * 2
