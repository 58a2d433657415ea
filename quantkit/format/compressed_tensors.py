"""The compressed-tensors "pack-quantized" layout (llm-compressor, vLLM's CompressedTensorsWNA16).

For a linear W [N, K] quantized to `bits` (4 or 8) with G groups along K:
  weight_packed      int32 [N, K / pf]   word c of row n holds columns pf*c .. pf*c+pf-1, column
                                          pf*c+j in bits bits*j .. (low bits first); pf = 32 / bits
  weight_scale       fp16  [N, G]        (G = 1 for per-channel, strategy "channel")
  weight_zero_point  int32 [N / pf, G]   asymmetric only: packed along N the same way
  weight_shape       int64 [2]           [N, K]
  weight_g_idx       int32 [K]           read only: older act-order checkpoints ("actorder": "group")
Act-order is written as compressed-tensors >= 0.20 defines it, "actorder": "weight": GPTQ visits
the columns by activation order but keeps the groups on the original columns (static groups), so no
g_idx is stored and every kernel runs it at normal speed. The library removed "group" (a stored
g_idx, non-contiguous groups); checkpoints that have it (compressed-tensors <= 0.19, as vLLM 0.32
and llm-compressor 0.14 ship) are still read.
Values are stored offset by 2**(bits-1): the library quantizes to signed q in [-8, 7] (4-bit) and
zero points in the same range, then packs q + 8. A stored nibble is therefore exactly quantkit's
unsigned code, and a symmetric weight (signed zero point 0) has the unsigned zero point 8, as
quantkit's symmetric schemes do. W = scale * (q - zp) either way.

The `quantization_config` is written as llm-compressor writes it: quant_method
"compressed-tensors", format "pack-quantized", one config group targeting "Linear", `ignore`
for the linears left float.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from quantkit.format.packing import PackedLinear, pack_cols, pack_rows, unpack_cols
from quantkit.format.primitives import QuantizedWeight

FORMAT = "pack-quantized"
G_IDX_ACTORDERS = ("group", "dynamic")  # the act-order kinds that store weight_g_idx ("dynamic": its alias)
TENSOR_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def ct_tensors(qw: QuantizedWeight, prefix: str, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """State-dict entries of one linear in the pack-quantized layout."""
    bits, (n, k) = qw.scheme.bits, qw.qweight.shape
    zeros = qw.zeros.round().to(torch.int64)  # [G, N], unsigned
    out = {
        f"{prefix}.weight_packed": pack_cols(qw.qweight, bits),  # [N, K / pf]
        f"{prefix}.weight_scale": qw.scales.T.contiguous().to(torch.float16),  # [N, G]
        f"{prefix}.weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if qw.scheme.sym:
        if (zeros != 2 ** (bits - 1)).any():
            raise ValueError("a symmetric compressed-tensors weight needs every zero point at 2**(bits-1)")
    else:
        out[f"{prefix}.weight_zero_point"] = pack_rows(zeros.T.contiguous(), bits)  # [N / pf, G]
    if qw.act_order:
        out[f"{prefix}.weight_g_idx"] = qw.g_idx.to(torch.int32)
    if bias is not None:
        out[f"{prefix}.bias"] = bias
    return out


def ct_to_packed(tensors: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool,
                 bias: torch.Tensor | None = None) -> PackedLinear:
    """One pack-quantized linear (`tensors` keyed by suffix) as the in-memory gptq_v2 PackedLinear.

    Raises ValueError naming the tensor when the shapes disagree with bits / group size.
    """
    packed, scale = tensors["weight_packed"], tensors["weight_scale"]
    pf = 32 // bits
    n, k = (int(d) for d in tensors["weight_shape"].tolist()) if "weight_shape" in tensors else (
        packed.shape[0], packed.shape[1] * pf)
    if tuple(packed.shape) != (n, k // pf) or k % pf:
        raise ValueError(f"weight_packed is {tuple(packed.shape)}, but {bits}-bit [{n}, {k}] packs to [{n}, {k // pf}]")
    groups = 1 if group_size == -1 else k // group_size
    if tuple(scale.shape) != (n, groups):
        raise ValueError(f"weight_scale is {tuple(scale.shape)}, but group size {group_size} over K={k} "
                         f"gives [{n}, {groups}]")
    codes = unpack_cols(packed, bits)  # [N, K] unsigned
    if sym:
        zeros = torch.full((groups, n), 2 ** (bits - 1), dtype=torch.int64)
    else:
        zp = tensors.get("weight_zero_point")
        if zp is None:
            raise ValueError("asymmetric scheme but no weight_zero_point")
        if tuple(zp.shape) != (n // pf, groups):
            raise ValueError(f"weight_zero_point is {tuple(zp.shape)}, expected [{n // pf}, {groups}]")
        zeros = unpack_cols(zp.T.contiguous(), bits).to(torch.int64)  # [G, N]
    g_idx = tensors.get("weight_g_idx")
    if g_idx is not None and (g_idx.numel() != k or int(g_idx.max()) >= groups or int(g_idx.min()) < 0):
        raise ValueError(f"weight_g_idx has {g_idx.numel()} entries with groups up to {int(g_idx.max())}; "
                         f"expected {k} entries below {groups}")
    return PackedLinear(
        "gptq_v2", bits, group_size,
        qweight=pack_rows(codes.T.contiguous(), bits),  # [K / pf, N]
        qzeros=pack_cols(zeros, bits),  # [G, N / pf]
        scales=scale.T.contiguous(),  # kept in the dtype stored (llm-compressor writes the model dtype)
        g_idx=None if g_idx is None else g_idx.to(torch.int32), bias=bias,
    )


def quantization_config(bits: int, group_size: int, sym: bool, actorder: str | None, ignore: list[str],
                        extra: dict | None = None) -> dict:
    """quantization_config as llm-compressor writes a W4A16 / W4A16_ASYM / W8A16 checkpoint; `actorder`
    None or "weight" (the tests' hand-made older checkpoints pass "group")."""
    weights = {
        "num_bits": bits, "type": "int", "symmetric": sym,
        "strategy": "channel" if group_size == -1 else "group",
        "group_size": None if group_size == -1 else group_size,
        "actorder": actorder, "dynamic": False, "observer": "minmax",
        "block_structure": None, "observer_kwargs": {},
    }
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
             "format": FORMAT}
    return {
        "quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
        "config_groups": {"group_0": group}, "ignore": list(ignore), "kv_cache_scheme": None,
        "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None, **(extra or {}),
    }


@dataclass(frozen=True)
class CTGroup:
    """One config group: which linears it targets and how their weights are stored."""

    targets: tuple[str, ...]
    bits: int
    group_size: int  # -1: per channel
    sym: bool
    act_order: bool  # a weight_g_idx is stored


def parse_quantization_config(qc: dict) -> tuple[tuple[CTGroup, ...], tuple[str, ...]]:
    """(config groups, ignore list) of a compressed-tensors config; ValueError naming what we do not run."""
    if qc.get("sparsity_config"):
        raise ValueError("sparsity (sparsity_config) is not supported")
    if qc.get("kv_cache_scheme"):
        raise ValueError("KV-cache quantization (kv_cache_scheme) is not supported")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"quantization_status {status!r} is not supported (quantkit reads compressed checkpoints)")
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        if fmt != FORMAT:
            raise ValueError(f"config group {name}: format {fmt!r} is not supported (quantkit reads {FORMAT!r})")
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(f"config group {name}: activation quantization is not supported (weight-only W4A16/W8A16)")
        groups.append(_parse_weights(name, group))
    if not groups:
        raise ValueError("no config_groups")
    return tuple(groups), tuple(qc.get("ignore") or ())


def _parse_weights(name: str, group: dict) -> CTGroup:
    w = group.get("weights") or {}
    kind, bits, strategy = w.get("type", "int"), int(w.get("num_bits", 0)), w.get("strategy")
    if kind != "int":
        raise ValueError(f"config group {name}: {kind} weights (e.g. FP8) are not supported")
    if bits not in (4, 8):
        raise ValueError(f"config group {name}: {bits}-bit weights are not supported (4 or 8)")
    if strategy not in ("group", "channel") or w.get("dynamic"):
        raise ValueError(f"config group {name}: weight strategy {strategy!r} is not supported (group or channel)")
    group_size = -1 if strategy == "channel" else int(w["group_size"])
    return CTGroup(tuple(group.get("targets") or ()), bits, group_size, bool(w.get("symmetric", True)),
                   w.get("actorder") in G_IDX_ACTORDERS)


def matches(target: str, module: str) -> bool:
    """compressed-tensors target matching for linears: "Linear", "re:<regex>", or a module name."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def group_for(groups: tuple[CTGroup, ...], module: str) -> CTGroup:
    """The group whose targets name `module` (a specific target wins over "Linear")."""
    specific = [g for g in groups if any(t != "Linear" and matches(t, module) for t in g.targets)]
    found = specific or [g for g in groups if "Linear" in g.targets]
    if not found:
        raise ValueError(f"{module}: packed, but no config group targets it")
    return found[0]
