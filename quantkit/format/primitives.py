"""Integer quantization primitives: min-max parameters, quantize, dequantize.

Conventions used everywhere in quantkit:
  weight  W: [N, K]  (out_features, in_features), as stored by torch.nn.Linear
  groups run along K: group g covers input columns [g*G, (g+1)*G)
  scale, zero: [N] for one group, or [num_groups, N] for a whole weight
  integer codes q in [0, 2**bits - 1]; W ~= scale * (q - zero)

Scales are rounded to fp16 as soon as they are computed, because fp16 is what the
checkpoint stores: the codes are then chosen against the exact scale a loader
will use, and dequantizing the packed checkpoint reproduces the fake-quantized
weight bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantScheme:
    """How a weight is quantized: bit width, group size along K (-1 = per channel), symmetry."""

    bits: int = 4
    group_size: int = 128
    sym: bool = True

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    def group_len(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def num_groups(self, in_features: int) -> int:
        g = self.group_len(in_features)
        return (in_features + g - 1) // g


def minmax_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point for each row of `w` from its min and max.

    w: [N, L] float. Returns scale [N] (fp16-representable, fp32 dtype) and zero [N] (integral, fp32).
    Symmetric schemes put the zero at the middle code (8 for 4 bits), as GPTQ does.
    """
    w = w.float()
    return range_params(w.amin(dim=-1), w.amax(dim=-1), bits, sym)  # amin: no indices, ~8-20x faster than min


def range_params(xmin: torch.Tensor, xmax: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point [...] that map the range [xmin, xmax] [...] (widened to hold 0) onto the codes; what
    minmax_params does with each row's min and max, and a scale search with shrunk ones."""
    maxq = 2**bits - 1
    xmin = torch.clamp(xmin, max=0)
    xmax = torch.clamp(xmax, min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    flat = (xmin == 0) & (xmax == 0)
    xmin = torch.where(flat, torch.full_like(xmin, -1.0), xmin)
    xmax = torch.where(flat, torch.full_like(xmax, 1.0), xmax)
    scale = round_scale((xmax - xmin) / maxq)
    if sym:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        zero = torch.round(-xmin / scale).clamp(0, maxq)
    return scale, zero


def round_scale(scale: torch.Tensor) -> torch.Tensor:
    """Round scales to the fp16 values the checkpoint will store, keeping them positive and finite."""
    tiny = torch.finfo(torch.float16).tiny
    return scale.float().clamp(min=tiny, max=torch.finfo(torch.float16).max).half().float()


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer codes for `w` [N, L] given per-row scale/zero [N] (or broadcastable). Returns float codes."""
    return torch.clamp(torch.round(w / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, maxq)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """scale * (q - zero) with per-row scale/zero [N] broadcast over columns."""
    return scale.unsqueeze(-1) * (q - zero.unsqueeze(-1))


@dataclass
class QuantizedWeight:
    """A weight in integer form, in the original column order.

    qweight: [N, K] codes, held as uint8 (0..2^bits - 1; given in any integer dtype); scales, zeros: [num_groups, N]
    (fp32, integral zeros); g_idx: [K] int32 group of each input column (act-order makes it non-monotonic).
    The codes are a byte each (the producers make them so; narrowing here is a guard) because weights wait in this
    form until they are packed: as int32 a layer's took as much memory as its fp32 weights (2.4 GB on a
    Qwen3-30B-A3B-shaped layer's 384 experts).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    scheme: QuantScheme

    def __post_init__(self):
        if self.scheme.bits > 8:
            raise ValueError(f"{self.scheme.bits}-bit codes do not fit a byte")
        if self.qweight.dtype != torch.uint8:
            self.qweight = self.qweight.to(torch.uint8)

    def dequantize(self) -> torch.Tensor:
        """W_hat [N, K] fp32 = scale * (q - zero), each column with its group's, made in place in one [N, K] buffer:
        with groups of consecutive columns the scales and zeros broadcast over each group, else (act-order) each is
        gathered to [N, K] in turn. (Gathering both and computing out of place held five [N, K] fp32 tensors at once:
        1.1 GB for an 8B model's down_proj.) The same numbers bit for bit: (q - z) * s is s * (q - z)."""
        n, k = self.qweight.shape
        out = self.qweight.float()
        groups, glen = self.scales.shape[0], self.scheme.group_len(k)
        if groups * glen == k and torch.equal(self.g_idx, default_g_idx(k, self.scheme, self.g_idx.device)):
            grouped = out.view(n, groups, glen)  # [N, groups, group_len]
            grouped.sub_(self.zeros.T.unsqueeze(-1)).mul_(self.scales.T.unsqueeze(-1))
            return out
        g = self.g_idx.long()
        return out.sub_(self.zeros[g].T).mul_(self.scales[g].T)

    @property
    def act_order(self) -> bool:
        g = self.g_idx.long()
        return bool((g[1:] < g[:-1]).any()) if g.numel() > 1 else False


def default_g_idx(in_features: int, scheme: QuantScheme, device: torch.device | str = "cpu") -> torch.Tensor:
    return (torch.arange(in_features, device=device) // scheme.group_len(in_features)).to(torch.int32)


# weights rounded at once by rtn_quantize: rows of about this many elements a step, so its fp32 temporaries stay
# near 16 MiB whatever the weight
RTN_STEP_ELEMENTS = 1 << 22


def rtn_quantize(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Round-to-nearest, group by group along K. w: [N, K] float. Every group of a slice of rows at once (the same
    arithmetic per group as minmax_params and quantize_codes on each group alone, so the same codes bit for bit)."""
    n, k = w.shape
    g = scheme.group_len(k)
    if k % g:  # a short last group: one group at a time
        return _rtn_by_group(w.float(), scheme)
    step = max(1, RTN_STEP_ELEMENTS // k)
    codes = torch.empty((n, k), dtype=torch.uint8, device=w.device)
    scales = torch.empty((n, k // g), dtype=torch.float32, device=w.device)
    zeros = torch.empty_like(scales)
    for lo in range(0, n, step):
        part = w[lo:lo + step].to(torch.float32, copy=True).reshape(-1, k // g, g)  # [rows, groups, G], ours
        s, z = range_params(part.amin(dim=-1), part.amax(dim=-1), scheme.bits, scheme.sym)
        q = part.div_(s.unsqueeze(-1)).round_().add_(z.unsqueeze(-1)).clamp_(0, scheme.maxq)
        codes[lo:lo + step] = q.reshape(-1, k)
        scales[lo:lo + step], zeros[lo:lo + step] = s, z
    return QuantizedWeight(codes, scales.T.contiguous(), zeros.T.contiguous(), default_g_idx(k, scheme, w.device),
                           scheme)


def _rtn_by_group(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    n, k = w.shape
    g = scheme.group_len(k)
    scales, zeros, codes = [], [], []
    for start in range(0, k, g):
        block = w[:, start : start + g]
        s, z = minmax_params(block, scheme.bits, scheme.sym)
        scales.append(s)
        zeros.append(z)
        codes.append(quantize_codes(block, s, z, scheme.maxq).to(torch.uint8))  # integral floats in [0, maxq]: exact
    return QuantizedWeight(
        qweight=torch.cat(codes, dim=1),
        scales=torch.stack(scales),
        zeros=torch.stack(zeros),
        g_idx=default_g_idx(k, scheme, w.device),
        scheme=scheme,
    )
