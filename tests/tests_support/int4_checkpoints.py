"""Packed 4-bit linears for the CPU kernel tests, and whole 4-bit checkpoints of the tiny test models."""

from __future__ import annotations

import torch

from quantkit.format.packing import pack
from quantkit.format.primitives import QuantizedWeight, QuantScheme, rtn_quantize


def checkpoint(n: int, k: int, group_size: int, layout: str, sym: bool, act_order: bool = False, seed: int = 0):
    """A packed 4-bit linear [N, K]; with act_order, a shuffled g_idx as GPTQ's desc_act writes it."""
    gen = torch.Generator().manual_seed(seed)
    qw = rtn_quantize(torch.randn(n, k, generator=gen), QuantScheme(4, group_size, sym))
    if act_order:
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)].to(torch.int32)
        qw = QuantizedWeight(qw.qweight, qw.scales, qw.zeros, g_idx, qw.scheme)
    p = pack(qw, layout)
    p.bias = torch.randn(n, generator=gen)
    return p


def quantize_tiny(model, tmp_path_factory, method: str, fmt: str, group_size: int):
    """`model` (a tiny test model's folder) quantized to 4 bits by `method` into layout `fmt`, calibrated on 8 samples
    of 64 tokens of the synthetic corpus; returns the checkpoint's folder."""
    from quantkit.calibration.synthetic import make_corpus
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.quant.pipeline import quantize_model

    tmp = tmp_path_factory.mktemp(f"{method}-{fmt}")
    calib = tmp / "calib.txt"
    calib.write_text("\n\n".join(make_corpus(64, seed=1)))
    out = tmp / "ckpt"
    out.mkdir()
    cfg = QuantizeConfig(model=str(model), out=out, method=method, format=fmt, bits=4, group_size=group_size,
                         calib=CalibConfig(source=str(calib), nsamples=8, seqlen=64), device="cpu")
    quantize_model(cfg, out_dir=out, show_progress=False)
    return out
