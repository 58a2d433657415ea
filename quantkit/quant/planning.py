"""What a quantize run will do, decided from the checkpoint's shapes alone (what `quantkit quantize --dry-run`
shows): which linears are packed and which stay float (and why), the calibration window, and the notes a reader of
the checkpoint needs (what vLLM refuses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from quantkit.config import QuantizeConfig
from quantkit.errors import QuantkitError
from quantkit.format.arch import ArchSpec, moe_shape
from quantkit.format.packing import packable
from quantkit.model.loader import read_quant_info
from quantkit.model.source import ModelSource

# What vLLM 0.32 refuses (read from its source; see docs/BENCHMARKS.md "Interop"), said up front.
VLLM_LIMITS = (
    (lambda c: c.layout == "gptq_v2",
     "asymmetric GPTQ (gptq_v2): vLLM 0.32 refuses sym=false; use --format awq for asymmetric weights it serves"),
    (lambda c: c.layout in ("gptq", "gptq_v2") and c.desc_act and c.group_size != -1,
     "act-order with groups: vLLM 0.32 refuses desc_act with a group size (quantkit and GPTQModel load it)"),
    (lambda c: c.bits == 8, "8-bit weights: vLLM 0.32's CPU kernel serves 4-bit only"),
)


@dataclass
class QuantizePlan:
    """What will be quantized, decided from shapes alone (this is what --dry-run shows)."""

    model_path: Path
    spec: ArchSpec
    num_layers: int
    quantized: list[str]  # full module names
    skipped: dict[str, str]  # full module name -> reason
    seqlen: int
    notes: list[str]
    source_bytes: int
    warnings: list[str] = field(default_factory=list)  # said loudly as they arise, and kept in quantkit_meta.json

    @cached_property
    def quantized_set(self) -> frozenset[str]:
        return frozenset(self.quantized)


def plan_quantization(cfg: QuantizeConfig, source: ModelSource) -> QuantizePlan:
    spec, config_dict, reader = source.spec, source.config, source.reader  # an unsupported architecture fails here
    if read_quant_info(config_dict) is not None:
        raise QuantkitError(f"{cfg.model}: already quantized (config.json has a quantization_config)")
    if cfg.gptaq and moe_shape(spec, config_dict):
        raise QuantkitError(f"--gptaq: {cfg.model} is a mixture of experts, whose experts are quantized one at a time; "
                            f"GPTAQ covers dense layers only (use plain GPTQ)")
    num_layers = int(config_dict["num_hidden_layers"])
    quantized, skipped = [], {}
    for i in range(num_layers):
        for linears in packing_units(spec, config_dict):
            names = [f"{spec.layers}.{i}.{n}" for n in linears]
            reasons = {}
            for full in names:
                shape = reader.shape_of(f"{full}.weight")
                reason = packable(shape[0], shape[1], cfg.scheme, cfg.layout)
                if reason:
                    reasons[full] = reason
            if not reasons:
                quantized.extend(names)
                continue
            # serving engines fuse the group into one linear: it is packed whole or not at all
            for full in names:
                skipped[full] = reasons.get(full) or f"fused with {next(iter(reasons)).rpartition('.')[2]}, which cannot be packed"
    if not quantized:
        reasons = sorted(set(skipped.values()))
        raise QuantkitError(f"no linear layer can be packed at group size {cfg.group_size} ({'; '.join(reasons)}); "
                            f"try a smaller --group-size")
    notes = [note for when, note in VLLM_LIMITS if when(cfg)]
    if cfg.gptaq:
        notes.append(f"GPTAQ (alpha {cfg.gptaq_alpha:g}{', true-sequential' if cfg.true_sequential else ''}): the float "
                     f"model's activations are carried beside the quantized one's, twice the activations' memory")
    max_len = int(config_dict.get("max_position_embeddings") or cfg.calib.seqlen)
    seqlen = cfg.calib.seqlen
    if seqlen > max_len:
        notes.append(f"--seqlen {seqlen} clipped to the model's context of {max_len} tokens")
        seqlen = max_len
    return QuantizePlan(source.path, spec, num_layers, quantized, skipped, seqlen, notes, reader.total_bytes())


def packing_units(spec: ArchSpec, config) -> list[tuple[str, ...]]:
    """Linears of a layer packed together or not at all: each spec group (serving engines fuse them), and each
    expert's gate, up and down (vLLM's fused MoE holds every expert in one layout)."""
    moe = moe_shape(spec, config)
    experts = [spec.experts.linears_of(e) for e in range(moe.num_experts)] if moe else []
    return [g.linears for g in spec.groups] + experts


def skipped_fused_names(plan: QuantizePlan) -> list[str]:
    """Fused module names (as vLLM sees them, e.g. model.layers.0.mlp.gate_up_proj) whose members are all float."""
    out = []
    for i in range(plan.num_layers):
        for group in plan.spec.groups:
            members = [f"{plan.spec.layers}.{i}.{n}" for n in group.linears]
            if group.fused and all(m in plan.skipped for m in members):
                out.append(f"{plan.spec.layers}.{i}.{group.fused}")
    return out


def float_modules(plan: QuantizePlan) -> list[str]:
    """Full names of the linears kept float by design (MoE routers), which readers must not take for packed."""
    return [f"{plan.spec.layers}.{i}.{n}" for i in range(plan.num_layers) for n in plan.spec.float_linears()]
