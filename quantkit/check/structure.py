"""The structure of one packed linear, checked against its config, and an independent dequantization.

`quantkit check` runs these on every packed linear, read straight from the shards, before any
input goes through the model: a checkpoint whose tensors contradict its config, or whose scales
or zero points cannot be right, fails here whatever the kernels say.

`independent_dequantize` reads the bit layouts with its own code (strided slices, one bit
position at a time), not with quantkit.format.packing: it is the oracle the model's torch path
and the Triton kernel are compared with, so a bug in the shared unpacking cannot hide itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.format.packing import AWQ_ORDER

FLOAT_SCALES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class LinearTensors:
    """One packed linear as stored (GPTQ: qweight [K/pf, N], AWQ: qweight [K, N/pf]; qzeros
    [G, N/pf]; scales [G, N]; g_idx [K] or None)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None = None


def expected_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear of a decoder layer (an MoE family's experts included), by its name relative to
    the layer, from the family's spec (format/arch.py) and the config's widths."""
    from quantkit.format.arch import config_dims, spec_for

    spec = spec_for(config)
    dims = config_dims(config)
    return {name: (dims[n], dims[k]) for name in spec.layer_linears(config) for n, k in [spec.dims_of(name)]}


# --- independent unpacking (the oracle) ------------------------------------------------------------

def _fields(words: torch.Tensor, bits: int, slot: int) -> torch.Tensor:
    """The `slot`-th bits-wide field of every int32 word, as int64 in [0, 2^bits)."""
    return (words.to(torch.int64) >> (bits * slot)) & ((1 << bits) - 1)


def unpack_along_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R / pf, C] -> int64 [R, C]: slot j of word r is row pf*r + j."""
    pf = 32 // bits
    out = torch.empty(words.shape[0] * pf, words.shape[1], dtype=torch.int64)
    for slot in range(pf):
        out[slot::pf] = _fields(words, bits, slot)
    return out


def unpack_along_cols(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C / pf] -> int64 [R, C]: slot i of word c is column pf*c + order[i] (order: identity)."""
    pf = 32 // bits
    order = order or tuple(range(pf))
    out = torch.empty(words.shape[0], words.shape[1] * pf, dtype=torch.int64)
    for slot, col in enumerate(order):
        out[:, col::pf] = _fields(words, bits, slot)
    return out


def codes_and_zeros(t: LinearTensors, layout: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [K, N] and true zero points [G, N] (int64; GPTQ v1's stored zero - 1 undone)."""
    if layout == "awq":
        return unpack_along_cols(t.qweight, bits, AWQ_ORDER), unpack_along_cols(t.qzeros, bits, AWQ_ORDER)
    zeros = unpack_along_cols(t.qzeros, bits)
    return unpack_along_rows(t.qweight, bits), zeros + 1 if layout == "gptq" else zeros


def row_groups(t: LinearTensors, k: int, group_size: int) -> torch.Tensor:
    """The group of each input row [K] int64: g_idx when stored, else consecutive groups."""
    if t.g_idx is not None:
        return t.g_idx.to(torch.int64)
    g = k if group_size == -1 else group_size
    return torch.div(torch.arange(k), g, rounding_mode="floor")


def independent_dequantize(t: LinearTensors, *, layout: str, bits: int, group_size: int) -> torch.Tensor:
    """W_hat [N, K] fp32: scale[g(k), n] * (code[k, n] - zero[g(k), n])."""
    codes, zeros = codes_and_zeros(t, layout, bits)
    groups = row_groups(t, codes.shape[0], group_size)
    scales = t.scales.float().index_select(0, groups)  # [K, N]
    return (scales * (codes - zeros.index_select(0, groups)).float()).T.contiguous()


# --- structure checks ------------------------------------------------------------------------------

def structure_problems(t: LinearTensors, expected: tuple[int, int] | None, *, layout: str, bits: int,
                       group_size: int, sym: bool, desc_act: bool) -> list[str]:
    """What is wrong with one packed linear, given what the config says; [] when nothing is.

    expected: (N, K) from the config (None: not a linear the config describes). Checks run in
    order and stop at the first shape problem, since later ones index with those shapes.
    """
    problems = _dtype_problems(t)
    if problems:
        return problems
    problems = _shape_problems(t, expected, layout, bits, group_size)
    if problems:
        return problems
    return _value_problems(t, layout, bits, group_size, sym, desc_act)


def _dtype_problems(t: LinearTensors) -> list[str]:
    problems = [f"{name} is {tensor.dtype}, expected torch.int32"
                for name, tensor in (("qweight", t.qweight), ("qzeros", t.qzeros)) if tensor.dtype != torch.int32]
    if t.scales.dtype not in FLOAT_SCALES:
        problems.append(f"scales are {t.scales.dtype}, expected a float type (fp16)")
    if t.g_idx is not None and (t.g_idx.dtype.is_floating_point or t.g_idx.dim() != 1):
        problems.append(f"g_idx is {t.g_idx.dtype} {tuple(t.g_idx.shape)}, expected an int32 vector")
    return problems


def _shape_problems(t: LinearTensors, expected: tuple[int, int] | None, layout: str, bits: int,
                    group_size: int) -> list[str]:
    pf = 32 // bits
    if t.scales.dim() != 2 or t.qweight.dim() != 2 or t.qzeros.dim() != 2:
        return ["qweight, qzeros and scales must be 2-D"]
    n = t.scales.shape[1]
    k = t.qweight.shape[0] if layout == "awq" else t.qweight.shape[0] * pf
    packed_n = t.qweight.shape[1] * pf if layout == "awq" else t.qweight.shape[1]
    if packed_n != n:
        return [f"qweight {tuple(t.qweight.shape)} does not pack {n} output columns at {bits} bits "
                f"(config bits {bits} disagree with the tensors?)"]
    if expected is not None and (n, k) != expected:
        return [f"shape N x K = {n} x {k} ({bits}-bit packing), config.json gives {expected[0]} x {expected[1]}"
                + (" (config bits disagree with the tensors?)" if n == expected[0] else "")]
    groups = 1 if group_size == -1 else -(-k // group_size)
    if t.scales.shape[0] != groups:
        return [f"scales hold {t.scales.shape[0]} groups; K={k} at config group_size {group_size} needs {groups}"]
    if tuple(t.qzeros.shape) != (groups, n // pf):
        return [f"qzeros are {tuple(t.qzeros.shape)}, expected {(groups, n // pf)}"]
    if t.g_idx is not None and (layout == "awq" or t.g_idx.numel() != k):
        return [f"g_idx holds {t.g_idx.numel()} rows, expected {k}" if layout != "awq"
                else "g_idx in an AWQ checkpoint (the AWQ layout has none)"]
    return []


def _value_problems(t: LinearTensors, layout: str, bits: int, group_size: int, sym: bool,
                    desc_act: bool) -> list[str]:
    problems = []
    scales = t.scales.float()
    if not torch.isfinite(scales).all():
        problems.append(f"{int((~torch.isfinite(scales)).sum())} scales are not finite")
    elif not (scales > 0).all():
        problems.append(f"{int((scales <= 0).sum())} of {scales.numel()} scales are not > 0")
    _, zeros = codes_and_zeros(LinearTensors(t.qweight[:1], t.qzeros, t.scales), layout, bits)
    maxq = (1 << bits) - 1
    if (zeros > maxq).any() or (zeros < 0).any():
        stored = " (GPTQ v1 stores zero - 1)" if layout == "gptq" else ""
        problems.append(f"zero points run {int(zeros.min())}..{int(zeros.max())}, outside [0, {maxq}]{stored}")
    elif sym and not (zeros == (maxq + 1) // 2).all():
        problems.append(f"config says sym, but the zero points run {int(zeros.min())}..{int(zeros.max())} "
                        f"(symmetric: all {(maxq + 1) // 2})")
    if t.g_idx is not None:
        problems += _g_idx_problems(t.g_idx.to(torch.int64), t.scales.shape[0], group_size, desc_act)
    return problems


def _g_idx_problems(g_idx: torch.Tensor, groups: int, group_size: int, desc_act: bool) -> list[str]:
    """g_idx must be a permutation of arange(K) // group_size; in that order unless desc_act."""
    k = g_idx.numel()
    if (g_idx < 0).any() or (g_idx >= groups).any():
        return [f"g_idx values run {int(g_idx.min())}..{int(g_idx.max())}, outside the {groups} groups"]
    default = torch.div(torch.arange(k), k if group_size == -1 else group_size, rounding_mode="floor")
    if not torch.equal(torch.sort(g_idx).values, default):
        return [f"g_idx does not give each group {group_size if group_size != -1 else k} rows "
                f"(inconsistent with the group size)"]
    if not desc_act and not torch.equal(g_idx, default):
        return ["g_idx is in act order, but config says desc_act false"]
    return []
