"""The rounding error of each candidate (scale, zero) of a group of weights: the scale search's inner loop
(quantkit.quant.scale_search), as a C++ kernel (kernels/csrc/group_error_cpu.cpp) and its pure-torch reference.

    err[r, c] = sum_j imp[r, j] * (s * (clamp(round(w[r, j] / s) + z, 0, maxq) - z) - w[r, j])^2

In torch every candidate is a temporary the size of the weights and seven passes over memory (a Llama-3.1-8B layer's
data-free search took about 10 s on two cores); the kernel reads a group once and runs every candidate over it in
registers. Its terms are the reference's bit for bit (the same division, rounding, clamps and unfused arithmetic);
its sums add them in another order, so an error can differ from the reference's by a few ulps, and a search that
compares two candidates of nearly equal error may pick the other one.
"""

from __future__ import annotations

import torch

from quantkit.kernels.cpu_ext import cpu_extension_unavailable, load_cpu_extension

EXTENSION = "quantkit_search"
SOURCES = ("group_error_cpu.cpp",)


def extension():
    """The compiled kernel module, or None (then `unavailable()` says why)."""
    return load_cpu_extension(EXTENSION, SOURCES)


def unavailable() -> str | None:
    return None if extension() is not None else cpu_extension_unavailable(EXTENSION)


def group_error_reference(w: torch.Tensor, imp: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor,
                          maxq: int) -> torch.Tensor:
    """sum_j imp_j (w_j - dequant_j)^2 per group: w [..., G], imp broadcastable to w (None: 1), scale/zero [...].
    One temporary the size of w, updated in place (bound by memory traffic): the codes less the zero are round(w / s)
    clamped to [-z, maxq - z], which is clamp(round(w / s) + z, 0, maxq) - z exactly (small integers)."""
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    d = torch.div(w, s).round_()
    torch.maximum(d, z.neg(), out=d)
    torch.minimum(d, maxq - z, out=d)
    if d.numel() > w.numel():  # w broadcast over candidates: -w once, then s (q - z) + (-w) in one pass
        torch.addcmul(w.neg(), d, s, out=d)  # unfused: the same rounding as s (q - z) - w
    else:
        d.mul_(s).sub_(w)
    d.square_()  # (s (q - z) - w)^2
    return (d if imp is None else d.mul_(imp)).sum(-1)


def serves(w: torch.Tensor) -> bool:
    """Whether the kernel takes the groups w [R, G]: built, and w a 2-d fp32 CPU tensor."""
    return w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and extension() is not None


def candidate_errors(w: torch.Tensor, imp: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor,
                     maxq: int) -> torch.Tensor | None:
    """The kernel's err [R, C] for w [R, G] fp32, imp [R, G] or None, scale / zero [R, C] (or [R] for one candidate,
    or broadcastable to [R, C]); None where the kernel does not serve (not built, or tensors off the CPU or not
    fp32), and the caller takes the reference."""
    if not serves(w) or scale.dtype != torch.float32 or zero.dtype != torch.float32:
        return None
    rows = len(w)
    one = scale.dim() == 1
    s = (scale.unsqueeze(-1) if one else scale).expand(rows, -1).contiguous()
    z = (zero.unsqueeze(-1) if one else zero).expand(rows, -1).contiguous()
    weights = torch.empty(0) if imp is None else imp.expand_as(w).contiguous()
    err = extension().group_errors(w.contiguous(), weights, s, z, maxq)
    return err.squeeze(-1) if one else err
