"""An MXFP4 copy of a float gpt-oss checkpoint (its experts as OpenAI ships them, quantkit.format.mxfp4.encode), and
its float twin: the same model with the experts' dequantized values stored stacked in fp32, so transformers and vLLM
run exactly what the MXFP4 checkpoint stands for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


def mxfp4_twin(src: Path, out: Path) -> tuple[Path, Path]:
    """(an MXFP4 checkpoint of the float gpt-oss `src`, its float twin), written under `out`."""
    from safetensors.torch import load_file, save_file

    from quantkit.format.mxfp4 import dequantize_stacked, encode_stacked

    tensors = load_file(str(Path(src) / "model.safetensors"))
    packed, twin = {}, {}
    for key, t in tensors.items():
        name = key.rpartition(".")[2]
        if name in EXPERT_PROJECTIONS:  # [E, in, out] -> the blocks of [E, out, in]
            blocks, scales = encode_stacked(t)
            packed[f"{key}_blocks"], packed[f"{key}_scales"] = blocks, scales
            twin[key] = dequantize_stacked(blocks, scales, torch.float32)
        else:
            packed[key] = twin[key] = t
    config = json.loads((Path(src) / "config.json").read_text())
    dirs = []
    for kind, state, cfg in (("mxfp4", packed, {**config, "quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}}),
                             ("float", twin, config)):
        d = Path(out) / kind
        d.mkdir(parents=True)
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in Path(src).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                shutil.copyfile(f, d / f.name)
        dirs.append(d)
    return dirs[0], dirs[1]
