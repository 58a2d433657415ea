"""Build the engine's decoder and load a float or quantized checkpoint into it.

Float tensors load by name from the safetensors shards. A linear with packed weights in the shards
(GPTQ v1/v2, AWQ GEMM or compressed-tensors pack-quantized, as `config.json["quantization_config"]`
says) becomes a `QuantLinear`, exactly as quantkit's transformers loader does it; on CPU it is then
repacked for quantkit's 4-bit kernel (torch's int4/int8 kernels where it does not build) and its
checkpoint tensors dropped. The weight memory is logged at load.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.engine.decoder import Decoder, DecoderShape
from quantkit.engine.rope import inv_frequencies
from quantkit.errors import QuantkitError
from quantkit.model.checkpoint import ShardReader, read_config
from quantkit.model.loader import QuantInfo, hf_config, replace_packed_linears
from quantkit.model.quant_format import checkpoint_quant_info
from quantkit.model.quant_linear import QuantLinear
from quantkit.format.arch import get_submodule, spec_for

log = logging.getLogger("quantkit.engine")


def load_decoder(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[Decoder, QuantInfo | None]:
    """The decoder with every weight of the checkpoint at `path` loaded, in eval mode on `device`."""
    config_dict = read_config(path)
    spec_for(config_dict)  # unsupported architectures fail here, with the supported list
    info = checkpoint_quant_info(path, config_dict)
    shape = DecoderShape.from_config(hf_config(path))
    reader = ShardReader(path)
    with torch.device("meta"):
        model = Decoder(shape)
    quantized = replace_packed_linears(model, reader, info, dtype)
    state = {}
    for key in reader.keys():
        if key.rpartition(".")[0] in quantized or "rotary_emb" in key:
            continue
        t = reader.get(key)
        state[key] = t.to(dtype) if t.is_floating_point() else t
    if shape.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if v is not None},
                                                strict=False, assign=True)
    if unexpected:
        raise QuantkitError(f"{path}: unexpected tensors in the checkpoint: {', '.join(unexpected[:5])}")
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise QuantkitError(f"{path}: tensors missing from the checkpoint: {', '.join(still_meta[:5])}")
    # RoPE frequencies are not in checkpoints: the meta buffer is rebuilt for real.
    model.inv_freq = inv_frequencies(shape.rope, shape.head_dim, shape.max_position_embeddings)
    model = model.to(device).eval()
    if device.type == "cpu":
        repack_quant_linears(model, dtype)
        prepack_float_linears(model, dtype)
    log.info(WeightMemory.of(model).describe())
    return model, info


def repack_quant_linears(model: torch.nn.Module, dtype: torch.dtype) -> Counter:
    """Every QuantLinear into the CPU kernels' layout, checkpoint tensors dropped; counts of each path."""
    paths = Counter(m.repack_for_cpu(dtype) for m in model.modules() if isinstance(m, QuantLinear))
    for path, n in paths.items():
        if path.startswith("dense"):
            log.warning("%d quantized linears run dequantized to a dense copy on CPU: %s", n, path)
    return paths


def prepack_float_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Every float nn.Linear into a oneDNN-prepacked PrepackedLinear where this CPU supports it for `dtype`
    (a tied lm_head stays: prepacking would copy the embedding). Returns how many were replaced."""
    from quantkit.kernels.cpu_linear import PrepackedLinear, prepack_supported

    if not prepack_supported(dtype):
        log.info("linears: F.linear (oneDNN has no prepacked %s path on this CPU)", dtype)
        return 0
    fused = fuse_float_projections(model, PrepackedLinear.concat)
    embed = model.model.embed_tokens.weight
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is torch.nn.Linear and m.weight.data_ptr() != embed.data_ptr()]
    for name, m in targets:
        parent, _, attr = name.rpartition(".")
        setattr(get_submodule(model, parent) if parent else model, attr, PrepackedLinear(m))
    log.info("linears: %d prepacked for oneDNN (%s), %d of them fused q/k/v or gate/up", len(targets) + fused,
             dtype, fused)
    return len(targets) + fused


def fuse_float_projections(model: torch.nn.Module, concat) -> int:
    """Each layer's q/k/v and gate/up, where all are float nn.Linear, into one `concat([...])` linear
    (quantized layers keep theirs). Returns how many fused linears were made."""
    n = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        if all(type(m) is torch.nn.Linear for m in qkv):
            attn.fuse(concat(qkv))
            n += 1
        if type(mlp.gate_proj) is torch.nn.Linear and type(mlp.up_proj) is torch.nn.Linear:
            mlp.fuse(concat([mlp.gate_proj, mlp.up_proj]))
            n += 1
    return n


@dataclass(frozen=True)
class WeightMemory:
    """Resident weight bytes, against the same model held densely in bf16."""

    resident: int
    bf16_equivalent: int
    paths: dict[str, int]  # how the quantized linears run on CPU (empty for a float model)
    quantized: int = 0  # resident bytes of the quantized linears
    quantized_bf16: int = 0  # the same linears held densely in bf16

    @classmethod
    def of(cls, model: torch.nn.Module) -> WeightMemory:
        resident = dense = 0
        seen: set[int] = set()
        quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
        for m in quant:
            resident += m.weight_bytes()
            dense += 2 * (m.in_features * m.out_features + (m.out_features if m.bias is not None else 0))
            seen.update(id(t) for t in m.buffers())
        quantized, quantized_bf16 = resident, dense
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) in seen:  # (parameters() already lists a tied embedding once)
                continue
            seen.add(id(t))
            resident += t.numel() * t.element_size()
            dense += 2 * t.numel()
        return cls(resident, dense, dict(Counter(m.cpu_path for m in quant)), quantized, quantized_bf16)

    def describe(self) -> str:
        mib = 1024**2
        text = (f"weights: {self.resident / mib:.1f} MiB resident, {self.resident / self.bf16_equivalent:.2f}x "
                f"of the model in bf16 ({self.bf16_equivalent / mib:.1f} MiB)")
        if self.paths:
            text += (f"; quantized linears {self.quantized / mib:.1f} MiB, {self.quantized / self.quantized_bf16:.2f}x "
                     "of theirs in bf16: " + ", ".join(f"{n} {p}" for p, n in sorted(self.paths.items())))
        return text
