"""Load float or quantized checkpoints into transformers models.

A quantized checkpoint (GPTQ v1/v2 or AWQ layout, recognised from
`config.json["quantization_config"]`) is built as a skeleton on the meta device; every
linear that has a `qweight` in the shards becomes a `QuantLinear`, and all other tensors
load as they are. No transformers quantizer is involved: this is quantkit's own path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.model.checkpoint import ShardReader, read_config, resolve_model_path
from quantkit.model.quant_linear import QuantLinear
from quantkit.format.arch import get_submodule, spec_for
from quantkit.format.packing import PackedLinear


@dataclass(frozen=True)
class QuantInfo:
    """What a checkpoint's quantization_config says, normalised."""

    method: str  # "gptq" or "awq"
    layout: str  # "gptq", "gptq_v2" or "awq"
    bits: int
    group_size: int
    desc_act: bool = False
    sym: bool = True
    modules_to_not_convert: tuple[str, ...] = field(default_factory=tuple)


def read_quant_info(config: dict) -> QuantInfo | None:
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "gptq":
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantkitError(f"unsupported GPTQ checkpoint_format {fmt!r}")
        return QuantInfo("gptq", fmt, int(qc["bits"]), int(qc["group_size"]), bool(qc.get("desc_act", False)),
                         bool(qc.get("sym", True)), tuple(qc.get("modules_to_not_convert") or ()))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantkitError(f"unsupported AWQ version {version!r} (quantkit reads the GEMM layout)")
        return QuantInfo("awq", "awq", int(qc.get("bits", qc.get("w_bit", 4))),
                         int(qc.get("group_size", qc.get("q_group_size", 128))), False,
                         not bool(qc.get("zero_point", True)), tuple(qc.get("modules_to_not_convert") or ()))
    raise QuantkitError(f"unsupported quant_method {method!r} (quantkit reads gptq and awq)")


def hf_config(path: Path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(path))
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    return cfg


def build_skeleton(config, dtype: torch.dtype) -> nn.Module:
    """A CausalLM with every parameter on the meta device and real (CPU) RoPE buffers."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _rebuild_meta_buffers(model, config)
    return model


def _rebuild_meta_buffers(model: nn.Module, config) -> None:
    """Non-persistent buffers (RoPE inv_freq) are not in checkpoints: rebuild their owners on CPU."""
    owners = {name.rpartition(".")[0] for name, buf in model.named_buffers() if buf.is_meta}
    for owner in sorted(owners):
        parent_name, _, attr = owner.rpartition(".")
        parent = get_submodule(model, parent_name) if parent_name else model
        module = getattr(parent, attr)
        setattr(parent, attr, type(module)(config=config))


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_path(str(path))))


def load_model(name: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               backend: str = "auto") -> tuple[nn.Module, QuantInfo | None]:
    """A float checkpoint through transformers, or a quantized one with QuantLinear layers."""
    path = resolve_model_path(str(name))
    config_dict = read_config(path)
    spec_for(config_dict)  # unsupported architectures fail here, with the list
    info = read_quant_info(config_dict)
    reader = ShardReader(path)
    config = hf_config(path)
    model = build_skeleton(config, dtype)
    state: dict[str, torch.Tensor] = {}
    quantized = {k[: -len(".qweight")] for k in reader.keys() if k.endswith(".qweight")}
    if quantized and info is None:
        raise QuantkitError(f"{path}: packed weights found but config.json has no quantization_config")
    for prefix in sorted(quantized):
        get = lambda suffix: reader.get(f"{prefix}.{suffix}") if f"{prefix}.{suffix}" in reader else None  # noqa: E731
        bias = get("bias")
        packed = PackedLinear(info.layout, info.bits, info.group_size, get("qweight"), get("qzeros"),
                              get("scales"), get("g_idx"), None if bias is None else bias.to(dtype))
        parent_name, _, attr = prefix.rpartition(".")
        setattr(get_submodule(model, parent_name), attr, QuantLinear(packed, backend=backend))
    for key in reader.keys():
        if key.rpartition(".")[0] in quantized:
            continue
        t = reader.get(key)
        state[key] = t.to(dtype) if t.is_floating_point() else t
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" in missing:
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise QuantkitError(f"{path}: tensors missing from the checkpoint: {', '.join(still_meta[:5])}")
    if unexpected:
        raise QuantkitError(f"{path}: unexpected tensors in the checkpoint: {', '.join(unexpected[:5])}")
    model.eval()
    return model.to(device), info
