"""Peers' checkpoint layouts built from their documented specs, independently of quantkit.format.

Each linear of a float checkpoint is round-to-nearest quantized here (with an optional act-order
permutation), then packed the way AutoGPTQ (v1), GPTQModel (v2, `dynamic` rules), AutoAWQ (GEMM)
or compressed-tensors (pack-quantized, through the library itself where it can) write it. The
dense weight each linear should dequantize to is returned beside the folder.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj$")


@dataclass
class Layout:
    kind: str  # gptq_v1, gptq_v1_legacy, gptq_v2, awq, ct
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: bool = False
    dynamic: dict = field(default_factory=dict)  # GPTQModel rules (gptq_v2 only)


def rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: bool, seed: int = 0):
    """codes [N, K], scales [G, N] fp16, zeros [G, N] (unsigned), g_idx [K]: W ~ s[g] * (q - z[g])."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    wp = w[:, perm].float().view(n, k // g, g)
    maxq = 2**bits - 1
    if sym:
        amax = wp.abs().amax(-1).clamp(min=1e-5)
        scale = (2 * amax / maxq).half().float()
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)
        scale = ((hi - lo).clamp(min=1e-5) / maxq).half().float()
        zero = (-lo / scale).round().clamp(0, maxq)
    codes_p = (wp / scale[..., None]).round().add(zero[..., None]).clamp(0, maxq).view(n, k).to(torch.int64)
    codes = torch.empty_like(codes_p)
    codes[:, perm] = codes_p
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
    return codes, scale.T.contiguous(), zero.T.contiguous().to(torch.int64), g_idx


def words_along(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Pack `values` (unsigned) along `dim`: element pf*i + j of a run sits at bits bits*j (or, with
    `order`, the element order[j] of each run of pf does), low bits first."""
    pf = 32 // bits
    v = values.to(torch.int64).movedim(dim, 0)
    out = torch.zeros((v.shape[0] // pf, *v.shape[1:]), dtype=torch.int64)
    for j in range(pf):
        src = order[j] if order else j
        out |= v[src::pf] << (bits * j)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.movedim(0, dim).contiguous()


def pack_linear(layout: Layout, codes, scales, zeros, g_idx, bits) -> dict[str, torch.Tensor]:
    act = layout.act_order
    if layout.kind.startswith("gptq"):
        z = zeros - 1 if layout.kind.startswith("gptq_v1") else zeros
        return {"qweight": words_along(codes.T, bits, 0), "qzeros": words_along(z, bits, 1),
                "scales": scales.half(), "g_idx": g_idx}
    if layout.kind == "awq":
        order = (0, 2, 4, 6, 1, 3, 5, 7)
        return {"qweight": words_along(codes.T, 4, 1, order), "qzeros": words_along(zeros, 4, 1, order),
                "scales": scales.half()}
    if layout.kind == "ct":
        out = _ct_pack(codes, scales, zeros, bits, layout.sym) if not act else {
            "weight_packed": words_along(codes, bits, 1), "weight_scale": scales.T.contiguous().half(),
            "weight_shape": torch.tensor(list(codes.shape)), "weight_g_idx": g_idx}
        if act and not layout.sym:
            out["weight_zero_point"] = words_along(zeros.T, bits, 0)
        return out
    raise ValueError(layout.kind)


def _ct_pack(codes, scales, zeros, bits, sym) -> dict[str, torch.Tensor]:
    """compressed-tensors' own compressor on the dequantized weight, with these scales and zero points."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    group_size = codes.shape[1] // scales.shape[0]
    qc = ct_config(bits, -1 if scales.shape[0] == 1 else group_size, sym, False)
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    g = torch.arange(codes.shape[1]) // group_size
    dense = scales.float()[g].T * (codes.float() - zeros.float()[g].T)
    state = {"weight": dense, "weight_scale": scales.T.contiguous().half(),
             "weight_zero_point": (zeros.T - 2 ** (bits - 1)).to(torch.int8).contiguous()}
    return dict(PackedQuantizationCompressor.compress(state, scheme))


def ct_config(bits, group_size, sym, act_order, ignore=("lm_head",)) -> dict:
    """As llm-compressor 0.14 writes a W4A16 / W4A16_ASYM / W8A16 checkpoint."""
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "group_size": None if group_size == -1 else group_size,
               "strategy": "channel" if group_size == -1 else "group", "actorder": "group" if act_order else None,
               "block_structure": None, "dynamic": False, "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None,
            "version": "0.17.0"}


def quant_config(layout: Layout) -> dict:
    base = {"bits": layout.bits, "group_size": layout.group_size}
    if layout.kind in ("gptq_v1", "gptq_v1_legacy"):  # AutoGPTQ: no checkpoint_format key
        return {"quant_method": "gptq", **base, "desc_act": layout.act_order, "sym": layout.sym,
                "damp_percent": 0.01, "true_sequential": True, "model_file_base_name": "model"}
    if layout.kind == "gptq_v2":
        return {"quant_method": "gptq", **base, "desc_act": layout.act_order, "sym": layout.sym,
                "checkpoint_format": "gptq_v2", "dynamic": layout.dynamic, "lm_head": False}
    if layout.kind == "awq":
        return {"quant_method": "awq", **base, "zero_point": not layout.sym, "version": "gemm",
                "modules_to_not_convert": None}
    return ct_config(layout.bits, layout.group_size, layout.sym, layout.act_order)


def _rule(layout: Layout, name: str) -> dict | None:
    """GPTQModel's dynamic lookup: None = left float, else the overrides of the first positive match."""
    for pattern, overrides in layout.dynamic.items():
        if pattern.startswith("-:") and re.match(pattern[2:], name):
            return None
        if not pattern.startswith("-:") and re.match(pattern.removeprefix("+:"), name):
            return overrides
    return {}


def write_layout(src: Path, out: Path, layout: Layout) -> dict[str, torch.Tensor]:
    """Write `src` (a float checkpoint folder) quantized in `layout` to `out`; returns name -> dense W_hat [N, K]."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    expected = {}
    for key in [k for k in tensors if k.endswith(".weight") and LINEAR.match(k[:-7])]:
        name = key[:-7]
        rule = _rule(layout, name)
        if rule is None:
            continue
        bits, gs = int(rule.get("bits", layout.bits)), int(rule.get("group_size", layout.group_size))
        w = tensors.pop(key)
        codes, scales, zeros, g_idx = rtn(w, bits, gs, layout.sym, layout.act_order, seed=len(expected))
        expected[name] = scales.float()[g_idx.long()].T * (codes.float() - zeros.float()[g_idx.long()].T)
        tensors.update({f"{name}.{s}": t for s, t in pack_linear(layout, codes, scales, zeros, g_idx, bits).items()})
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    if layout.kind == "gptq_v1_legacy":  # old AutoGPTQ: quantize_config.json only
        (out / "quantize_config.json").write_text(json.dumps(quant_config(layout)))
    else:
        config["quantization_config"] = quant_config(layout)
    (out / "config.json").write_text(json.dumps(config))
    return expected
