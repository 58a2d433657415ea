"""The quantized lm_head (GPTQModel's lm_head=True): packed tensors against the RTN reference, and refusals."""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantizeConfig
from quantkit.errors import QuantkitError
from quantkit.format.packing import PackedLinear, dequantize
from quantkit.format.primitives import QuantScheme, rtn_quantize
from quantkit.quant.lm_head import quantize_lm_head, refuse_tied


@pytest.mark.parametrize("vocab,hidden,group", [(512, 128, 64), (1000, 256, 128), (96, 64, -1)])
def test_packed_lm_head_dequantizes_to_the_rtn_reference(vocab, hidden, group):
    w = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(vocab))  # [vocab, hidden] fp32
    scheme = QuantScheme(4, group, True)
    result = quantize_lm_head(w, scheme, "gptq")
    t = result.tensors
    assert set(t) == {"lm_head.qweight", "lm_head.qzeros", "lm_head.scales", "lm_head.g_idx"}
    assert t["lm_head.qweight"].shape == (hidden // 8, vocab)  # qweight: [hidden // 8, vocab] int32
    p = PackedLinear("gptq", 4, group, t["lm_head.qweight"], t["lm_head.qzeros"], t["lm_head.scales"],
                     t["lm_head.g_idx"], None)
    want = rtn_quantize(w, scheme).dequantize().float()
    torch.testing.assert_close(dequantize(p), want, rtol=0, atol=0)
    assert result.loss == pytest.approx(float(((w - want) ** 2).sum()), rel=1e-5)


def test_tied_embeddings_are_refused():
    with pytest.raises(QuantkitError, match="ties lm_head"):
        refuse_tied({"tie_word_embeddings": True})
    refuse_tied({"tie_word_embeddings": False})


def test_quantize_lm_head_is_gptq_layout_only(tmp_path):
    with pytest.raises(QuantkitError, match="GPTQ layout only"):
        QuantizeConfig(model=str(tmp_path / "m"), out=tmp_path / "o", method="awq", quantize_lm_head=True)
    cfg = QuantizeConfig(model=str(tmp_path / "m"), out=tmp_path / "o", method="rtn", quantize_lm_head=True)
    assert cfg.to_dict()["quantize_lm_head"] is True
