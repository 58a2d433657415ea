"""Load float or quantized checkpoints into transformers models.

A quantized checkpoint (GPTQ v1/v2, AWQ GEMM or compressed-tensors pack-quantized, recognised from
`config.json["quantization_config"]`, see quant_format.py) is built as a skeleton on the meta device;
every linear that has packed weights in the shards becomes a `QuantLinear`, and all other tensors
load as they are. No transformers quantizer is involved: this is quantkit's own path.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.model.checkpoint import ShardReader
from quantkit.model import chunked_attention
from quantkit.model.moe import linearize_experts
from quantkit.model.quant_linear import QuantLinear
from quantkit.model.source import ModelSource, open_model
from quantkit.format.arch import get_submodule, spec_for
from quantkit.format import compressed_tensors as ct
from quantkit.model.quant_format import QuantInfo, packed_prefixes, read_packed, read_quant_info, require_finite_scales

__all__ = ["QuantInfo", "build_skeleton", "load_model", "load_tokenizer", "read_quant_info", "replace_packed_linears"]


def build_skeleton(config, dtype: torch.dtype) -> nn.Module:
    """A CausalLM with every parameter on the meta device and real (CPU) RoPE buffers; an MoE family's
    experts as one linear each, under the checkpoint's names (quantkit.model.moe)."""
    from transformers import AutoModelForCausalLM

    spec = spec_for(config)
    # attention transformers computes only eagerly (gpt-oss's sinks): a block of queries at a time, so a calibration
    # run does not hold every score of every head at once (quantkit.model.chunked_attention)
    attn = {"attn_implementation": chunked_attention.register()} if spec.attn_sinks else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **attn)
    linearize_experts(model, spec, config, dtype)
    _rebuild_meta_buffers(model, config)
    return model


def _rebuild_meta_buffers(model: nn.Module, config) -> None:
    """Non-persistent buffers (RoPE inv_freq, Gemma's embedding scale) are not in checkpoints: each owner is
    rebuilt on CPU from the config where its constructor takes one (rotary embeddings), else its buffers are
    made real and filled by the model's own initializer (transformers' `_init_weights` computes them)."""
    owners = {name.rpartition(".")[0] for name, buf in model.named_buffers() if buf.is_meta}
    for owner in sorted(owners):
        parent_name, _, attr = owner.rpartition(".")
        parent = get_submodule(model, parent_name) if parent_name else model
        module = getattr(parent, attr)
        if "config" in inspect.signature(type(module)).parameters:
            setattr(parent, attr, type(module)(config=config))
            continue
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype)
        model._init_weights(module)


def replace_packed_linears(model: nn.Module, reader: ShardReader, info: QuantInfo | None, dtype: torch.dtype,
                           backend: str = "auto", finite_scales: bool = True) -> set[str]:
    """Every linear with packed weights in `reader` becomes a QuantLinear; returns their names. With
    `finite_scales`, scales holding NaN or inf are refused, naming the tensor (`quantkit check` loads such a
    checkpoint all the same, to report on every layer)."""
    quantized = packed_prefixes(reader.keys())
    if quantized and info is None:
        raise QuantkitError(f"{reader.path}: packed weights found but config.json has no quantization_config")
    scales = "weight_scale" if info is not None and info.layout == ct.FORMAT else "scales"
    for prefix in sorted(quantized):
        parent_name, _, attr = prefix.rpartition(".")
        parent = get_submodule(model, parent_name) if parent_name else model  # (a quantized lm_head)
        packed = read_packed(reader, prefix, info, getattr(parent, attr, None), dtype)
        if finite_scales:
            require_finite_scales(packed, f"{reader.path}: {prefix}.{scales}")
        setattr(parent, attr, QuantLinear(packed, backend=backend))
    return quantized


def load_tokenizer(source: str | Path | ModelSource):
    """A checkpoint's tokenizer, or a tokenizer's own folder (no config.json needed: --tokenizer), or a hub id's."""
    from transformers import AutoTokenizer

    if isinstance(source, (str, Path)) and (local := Path(str(source)).expanduser()).is_dir():
        return AutoTokenizer.from_pretrained(str(local))
    return AutoTokenizer.from_pretrained(str(open_model(source).path))


def load_model(name: str | Path | ModelSource, dtype: torch.dtype = torch.float32, device: str = "cpu",
               backend: str = "auto", finite_scales: bool = True) -> tuple[nn.Module, QuantInfo | None]:
    """A float checkpoint through transformers, or a quantized one with QuantLinear layers (`finite_scales`:
    see replace_packed_linears)."""
    source = open_model(name)
    path, info, reader, config = source.path, source.quant, source.reader, source.hf_config
    source.spec  # unsupported architectures fail here, with the list
    model = build_skeleton(config, dtype)
    state: dict[str, torch.Tensor] = {}
    quantized = replace_packed_linears(model, reader, info, dtype, backend, finite_scales)
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
