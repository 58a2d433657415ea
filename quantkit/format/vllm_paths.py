"""Which vLLM kernel each packed linear gets, and the tensor-parallel degrees it splits cleanly at.

The rules vLLM applies before it picks its Marlin W4A16/W8A16 kernels (gptq_marlin, awq_marlin,
compressed-tensors WNA16); a linear that fails one runs a slower fallback kernel (or is refused):
  - GPTQ: `sym` present in the quantization_config and true (Marlin's uint4b8 / uint8b128 types);
    AWQ: 4-bit with zero points; compressed-tensors: symmetric 4/8-bit, or asymmetric 4-bit
  - group size in {-1, 32, 64, 128}
  - the shard a GPU holds: N % 64 == 0 and K % 128 == 0
Under tensor parallelism q/k/v/gate/up split along N (column-parallel) and o/down along K
(row-parallel): a row-parallel shard must start on a group boundary and a packed word.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MARLIN_GROUP_SIZES = (-1, 32, 64, 128)
MARLIN_MIN_N, MARLIN_MIN_K = 64, 128
ROW_PARALLEL = ("o_proj", "down_proj")  # split along K; every other linear along N


@dataclass(frozen=True)
class PackedShape:
    """One packed linear as vLLM sees it. fmt: gptq, awq or compressed-tensors."""

    name: str
    out_features: int  # N
    in_features: int  # K
    bits: int
    group_size: int
    sym: bool
    fmt: str
    sym_declared: bool = True  # GPTQ: `sym` present in the quantization_config

    @property
    def row_parallel(self) -> bool:
        return self.name.rpartition(".")[2] in ROW_PARALLEL


def shard(layer: PackedShape, tp: int) -> tuple[int, int]:
    """(N, K) of the shard one GPU holds at tensor-parallel degree tp."""
    if layer.row_parallel:
        return layer.out_features, layer.in_features // tp
    return layer.out_features // tp, layer.in_features


def scheme_reason(layer: PackedShape) -> str | None:
    """Why the quantization scheme keeps this layer off Marlin (None: it does not)."""
    if layer.fmt == "gptq" and not layer.sym_declared:
        return "no `sym` in quantization_config (vLLM then assumes asymmetric)"
    if layer.fmt == "gptq" and not layer.sym:
        return "asymmetric GPTQ (Marlin's GPTQ types are symmetric)"
    if layer.fmt == "awq" and layer.bits != 4:
        return f"{layer.bits}-bit AWQ"
    if layer.fmt == "compressed-tensors" and not layer.sym and layer.bits != 4:
        return f"asymmetric {layer.bits}-bit (Marlin takes zero points at 4 bits only)"
    if layer.bits not in (4, 8):
        return f"{layer.bits}-bit weights"
    if layer.group_size not in MARLIN_GROUP_SIZES:
        return f"group size {layer.group_size} not in {{-1, 32, 64, 128}}"
    return None


def marlin_reason(layer: PackedShape, tp: int = 1) -> str | None:
    """Why vLLM will not run this layer on Marlin at degree tp (None: it will)."""
    reason = scheme_reason(layer)
    if reason:
        return reason
    n, k = shard(layer, tp)
    if n % MARLIN_MIN_N:
        return f"N={n} not a multiple of {MARLIN_MIN_N}"
    if k % MARLIN_MIN_K:
        return f"K={k} not a multiple of {MARLIN_MIN_K}"
    return None


def split_reason(layer: PackedShape, tp: int) -> str | None:
    """Why this layer does not split into tp shards on group and packed-word boundaries (None: it does)."""
    pf = 32 // layer.bits
    if layer.row_parallel:
        k = layer.in_features
        if k % tp:
            return f"K={k} does not split over {tp}"
        g = k if layer.group_size == -1 else layer.group_size
        if layer.group_size != -1 and (k // tp) % g:
            return f"K/{tp}={k // tp} not a multiple of group size {g}"
        if (k // tp) % pf:
            return f"K/{tp}={k // tp} not a multiple of {pf} (packed words)"
        return None
    n = layer.out_features
    if n % tp:
        return f"N={n} does not split over {tp}"
    if (n // tp) % pf:
        return f"N/{tp}={n // tp} not a multiple of {pf} (packed words)"
    return None


@dataclass
class FastPathReport:
    marlin: dict[str, str | None]  # layer -> None (Marlin) or why not, at tp 1
    tp: dict[int, dict[str, str]] = field(default_factory=dict)  # degree -> layer -> why it fails there

    @property
    def fallbacks(self) -> dict[str, str]:
        return {name: reason for name, reason in self.marlin.items() if reason}

    def to_dict(self) -> dict:
        return {"marlin": self.marlin, "tp": {str(k): v for k, v in self.tp.items()}}


def fast_path_report(layers: list[PackedShape], tps: tuple[int, ...] = (2, 4, 8)) -> FastPathReport:
    """Marlin or not for each layer, and per TP degree the layers that no longer split or lose Marlin."""
    report = FastPathReport({layer.name: marlin_reason(layer) for layer in layers})
    for tp in tps:
        problems = {}
        for layer in layers:
            reason = split_reason(layer, tp)
            if reason is None and report.marlin[layer.name] is None:
                lost = marlin_reason(layer, tp)
                reason = None if lost is None else f"falls off Marlin: {lost}"
            if reason:
                problems[layer.name] = reason
        report.tp[tp] = problems
    return report
