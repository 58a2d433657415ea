"""What a checkpoint's quantization config says, and each packed linear read as a `PackedLinear`.

Every layout quantkit reads becomes the in-memory GPTQ / AWQ `PackedLinear` at read time, so
everything above (QuantLinear, the engine, check, eval) sees one vocabulary:
  GPTQ v1 / v2   AutoGPTQ, GPTQModel (checkpoint_format, desc_act + g_idx, `dynamic` per-module rules)
  AWQ GEMM       AutoAWQ
  pack-quantized compressed-tensors / llm-compressor (W4A16, W4A16_ASYM, W8A16; act-order g_idx),
                 repacked into the gptq_v2 layout
The config is checked against the tensors: a disagreement (bits, group size, shapes) names the tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.errors import QuantkitError
from quantkit.format import compressed_tensors as ct
from quantkit.format.packing import PackedLinear, check_shapes, pack_factor
from quantkit.format.vllm_paths import PackedShape

GPTQ_FORMATS = ("gptq", "gptq_v2")
PACKED_SUFFIXES = (".qweight", ".weight_packed")


@dataclass(frozen=True)
class LinearScheme:
    """How one packed linear is stored."""

    bits: int
    group_size: int
    sym: bool


@dataclass(frozen=True)
class QuantInfo:
    """What a checkpoint's quantization_config says, normalised."""

    method: str  # quant_method: "gptq", "awq" or "compressed-tensors"
    layout: str  # as stored: "gptq", "gptq_v2", "awq" or "pack-quantized"
    bits: int
    group_size: int
    desc_act: bool = False
    sym: bool = True
    modules_to_not_convert: tuple[str, ...] = field(default_factory=tuple)
    dynamic: tuple[tuple[str, dict], ...] = ()  # GPTQModel rules: (regex, overrides), in order
    sym_declared: bool = True  # GPTQ: `sym` present in the config (vLLM assumes asymmetric without it)
    ct_groups: tuple[ct.CTGroup, ...] = ()

    def scheme_for(self, module: str) -> LinearScheme:
        """The scheme of `module` (a full name): GPTQModel's first matching positive rule, or the
        compressed-tensors group that targets it, else the checkpoint-wide one."""
        if self.ct_groups:
            g = ct.group_for(self.ct_groups, module)
            return LinearScheme(g.bits, g.group_size, g.sym)
        for pattern, overrides in self.dynamic:
            if pattern.startswith("-:") or not re.match(pattern.removeprefix("+:"), module):
                continue
            return LinearScheme(int(overrides.get("bits", self.bits)), int(overrides.get("group_size", self.group_size)),
                                bool(overrides.get("sym", self.sym)))
        return LinearScheme(self.bits, self.group_size, self.sym)


def read_quant_info(config: dict) -> QuantInfo | None:
    """The packed linears' scheme of a checkpoint, or None where it packs none: a float checkpoint, or gpt-oss's MXFP4
    experts, which quantkit reads dequantized (quantkit.model.mxfp4_reader) as float."""
    qc = config.get("quantization_config")
    if not qc or qc.get("quant_method") == "mxfp4":
        return None
    method = qc.get("quant_method")
    if method == "gptq":
        return _gptq_info(qc)
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantkitError(f"unsupported AWQ version {version!r} (quantkit reads the GEMM layout)")
        return QuantInfo("awq", "awq", int(qc.get("bits", qc.get("w_bit", 4))),
                         int(qc.get("group_size", qc.get("q_group_size", 128))), False,
                         not bool(qc.get("zero_point", True)), tuple(qc.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        try:
            groups, ignore = ct.parse_quantization_config(qc)
        except ValueError as exc:
            raise QuantkitError(f"unsupported compressed-tensors checkpoint: {exc}") from exc
        first = groups[0]
        return QuantInfo("compressed-tensors", ct.FORMAT, first.bits, first.group_size, first.act_order, first.sym,
                         ignore, ct_groups=groups)
    raise QuantkitError(f"unsupported quant_method {method!r} (quantkit reads gptq, awq and compressed-tensors)")


def _gptq_info(qc: dict) -> QuantInfo:
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise QuantkitError(f"unsupported GPTQ checkpoint_format {fmt!r} (quantkit reads gptq and gptq_v2)")
    dynamic = tuple((str(k), dict(v or {})) for k, v in (qc.get("dynamic") or {}).items())
    return QuantInfo("gptq", fmt, int(qc["bits"]), int(qc["group_size"]), bool(qc.get("desc_act", False)),
                     bool(qc.get("sym", True)), tuple(qc.get("modules_to_not_convert") or ()), dynamic,
                     sym_declared="sym" in qc)


def checkpoint_quant_info(path: Path, config: dict) -> QuantInfo | None:
    """read_quant_info, falling back on AutoGPTQ's quantize_config.json (older checkpoints have no
    quantization_config in config.json)."""
    info = read_quant_info(config)
    legacy = Path(path) / "quantize_config.json"
    if info is None and legacy.is_file():
        try:
            qc = json.loads(legacy.read_text())
        except (OSError, ValueError) as exc:
            raise QuantkitError(f"{legacy}: unreadable ({exc})") from exc
        info = read_quant_info({"quantization_config": {"quant_method": "gptq", **qc}})
    return info


def packed_prefixes(keys) -> set[str]:
    """Module names that hold packed weights (a qweight or a weight_packed)."""
    return {k.rpartition(".")[0] for k in keys if k.endswith(PACKED_SUFFIXES)}


def read_packed(reader, prefix: str, info: QuantInfo, module, dtype: torch.dtype) -> PackedLinear:
    """The packed linear `prefix` of `reader` as a PackedLinear; `module` is the float linear it replaces
    (its in/out features are the shapes the tensors must hold)."""
    def get(suffix: str) -> torch.Tensor | None:
        key = f"{prefix}.{suffix}"
        return reader.get(key) if key in reader else None

    n, k = getattr(module, "out_features", None), getattr(module, "in_features", None)
    if n is None or k is None:
        raise QuantkitError(f"{prefix}: packed weights on a module that is not a linear layer")
    bias = get("bias")
    bias = None if bias is None else bias.to(dtype)
    try:
        scheme = info.scheme_for(prefix)
        if info.layout == ct.FORMAT:
            tensors = {s: t for s in ct.TENSOR_SUFFIXES if (t := get(s)) is not None}
            packed = ct.ct_to_packed(tensors, scheme.bits, scheme.group_size, scheme.sym, bias)
        else:
            packed = PackedLinear(info.layout, scheme.bits, scheme.group_size, get("qweight"), get("qzeros"),
                                  get("scales"), get("g_idx"), bias)
        check_shapes(packed, n, k)
    except (ValueError, KeyError) as exc:
        raise QuantkitError(f"{reader.path}: {prefix}: {exc} (config and tensors disagree)") from exc
    return packed


def require_finite_scales(packed: PackedLinear, where: str) -> None:
    """QuantkitError naming `where` (the scales' checkpoint tensor) when scales hold NaN or inf: such a layer turns
    every activation after it into NaN, and a model that runs anyway prints token 0 over and over."""
    bad = int((~torch.isfinite(packed.scales)).sum())
    if bad:
        raise QuantkitError(f"{where}: {bad} of {packed.scales.numel()} scales are NaN or inf: the checkpoint is "
                            f"corrupt (`quantkit check` reports every layer)")


def packed_shapes(reader, info: QuantInfo) -> list[PackedShape]:
    """Each packed linear's (N, K) and scheme, from the shard headers alone (no tensor is read)."""
    out = []
    for name in sorted(packed_prefixes(reader.keys())):
        scheme = info.scheme_for(name)
        pf = pack_factor(scheme.bits)
        if info.layout == ct.FORMAT:
            n, words = reader.shape_of(f"{name}.weight_packed")
            k = words * pf
        elif info.layout == "awq":
            k, words = reader.shape_of(f"{name}.qweight")
            n = words * pf
        else:
            words, n = reader.shape_of(f"{name}.qweight")
            k = words * pf
        out.append(PackedShape(name, n, k, scheme.bits, scheme.group_size, scheme.sym, info.method, info.sym_declared))
    return out
