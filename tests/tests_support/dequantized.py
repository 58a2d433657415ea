"""A float copy of a quantized checkpoint, for transformers' own forward in the parity tests.

Every packed linear is read by quantkit's checkpoint reader (model/quant_format.py: GPTQ, AWQ and
compressed-tensors alike) and dequantized; every other tensor is copied as stored; config.json
loses its quantization_config. transformers then loads the copy by the checkpoint's own names
(an MoE family's per-expert names included, which transformers 5 stacks into its 3-D experts), so
its float forward runs exactly the weights the engine's 4-bit kernels hold.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch


def dequantized_copy(qdir: Path, out: Path) -> Path:
    from safetensors.torch import save_file

    from quantkit.format.packing import dequantize
    from quantkit.model.checkpoint import ShardReader, read_config
    from quantkit.model.quant_format import checkpoint_quant_info, packed_prefixes, packed_shapes, read_packed

    qdir, out = Path(qdir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = read_config(qdir)
    info = checkpoint_quant_info(qdir, config)
    reader = ShardReader(qdir)
    packed = packed_prefixes(reader.keys())
    tensors = {}
    for shape in packed_shapes(reader, info):
        p = read_packed(reader, shape.name, info, SimpleNamespace(out_features=shape.out_features,
                                                                  in_features=shape.in_features), torch.float32)
        tensors[f"{shape.name}.weight"] = dequantize(p, torch.float32).contiguous()
        if p.bias is not None:
            tensors[f"{shape.name}.bias"] = p.bias.float()
    for key in reader.keys():
        if key.rpartition(".")[0] not in packed:
            t = reader.get(key)
            tensors[key] = (t.float() if t.is_floating_point() else t).contiguous()
    save_file(restacked(tensors, config), str(out / "model.safetensors"), metadata={"format": "pt"})
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in qdir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copyfile(f, out / f.name)
    return out


def restacked(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """For a family whose checkpoints stack the experts (gpt-oss), the per-expert tensors of a quantkit checkpoint
    (`...experts.<e>.<proj>.weight` [out, in], `.bias`) stacked back as transformers loads them (`...experts.<proj>`
    [E, in, out], `<proj>_bias` [E, out]); other families' tensors as they are."""
    from quantkit.format.arch import spec_for

    spec = spec_for(config).experts
    if spec is None or not spec.stacked:
        return tensors
    head = f".{spec.block}.{spec.experts}."
    parts: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for key, t in tensors.items():
        prefix, found, rest = key.rpartition(head)
        index, _, leaf = rest.partition(".")
        proj, _, kind = leaf.partition(".")
        if not found or not index.isdigit() or proj not in spec.projections:
            out[key] = t
            continue
        name = f"{prefix}{head}{proj}" + ("_bias" if kind == "bias" else "")
        parts.setdefault(name, {})[int(index)] = t if kind == "bias" else t.t()
    for name, by_expert in parts.items():
        out[name] = torch.stack([by_expert[e] for e in sorted(by_expert)]).contiguous()
    return out
