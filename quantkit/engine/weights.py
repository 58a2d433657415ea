"""Build the engine's decoder and load a float or quantized checkpoint into it.

Float tensors load by name from the safetensors shards. A linear with packed weights in the shards
(GPTQ v1/v2, AWQ GEMM or compressed-tensors pack-quantized, as `config.json["quantization_config"]`
says) becomes a `QuantLinear`, exactly as quantkit's transformers loader does it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.engine.decoder import Decoder, DecoderShape
from quantkit.engine.rope import inv_frequencies
from quantkit.errors import QuantkitError
from quantkit.model.checkpoint import ShardReader, read_config
from quantkit.model.loader import QuantInfo, hf_config, replace_packed_linears
from quantkit.model.quant_format import checkpoint_quant_info
from quantkit.format.arch import spec_for


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
    return model.to(device).eval(), info
