"""quantkit.bench.awq_ablation: each variant's spec reaches the quantization it scores."""

from __future__ import annotations

import pytest

from quantkit.bench.awq_ablation import quantize_variant
from quantkit.config import CalibConfig, QuantizeConfig


def _quantize(model, tmp_path, variant):
    from quantkit.calibration.synthetic import make_corpus

    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(make_corpus(16, seed=3)))
    out = tmp_path / variant
    out.mkdir()
    cfg = QuantizeConfig(model=str(model), out=out, method="awq", group_size=32, device="cpu",
                         calib=CalibConfig(source=str(calib), nsamples=4, seqlen=32))
    return quantize_variant(cfg, out, variant)


@pytest.mark.parametrize("variant, clipped", [("base", 7), ("noclip", 5), ("clipnone", 0)])
def test_the_variants_clip_choice_reaches_the_pipeline(tiny_llama, tmp_path, variant, clipped):
    """`clipnone` clips no linear and `noclip` leaves q/k unclipped, in every layer (the clip statistics are what
    the layer's search did); the ablation once set a name the pipeline no longer read, and every variant was
    the base."""
    report = _quantize(tiny_llama, tmp_path, variant)
    assert report.layers
    assert all(len(layer.stats["clip"]) == clipped for layer in report.layers)
