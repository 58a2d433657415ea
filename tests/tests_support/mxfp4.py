"""An MXFP4 copy of a float gpt-oss checkpoint (its experts as OpenAI ships them), and its float twin: the same model
with the experts' dequantized values stored stacked in fp32, so transformers and vLLM run exactly what the MXFP4
checkpoint stands for. The encoder is the test's own (nearest FP4 code under the smallest power-of-two scale that
fits each block's largest magnitude), not a reference for anything."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


def encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (blocks uint8 [..., out, in / 32, 16], scales uint8 [..., out, in / 32])."""
    from quantkit.format.mxfp4 import BLOCK, FP4_VALUES, SCALE_BIAS

    x = w.float().reshape(*w.shape[:-1], -1, BLOCK)  # [..., G, 32]
    amax = x.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -SCALE_BIAS))
    exp = exp.clamp(-SCALE_BIAS, 127)
    codes = _nearest(x / torch.exp2(exp)[..., None], torch.tensor(FP4_VALUES))  # [..., G, 32]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [..., G, 16]
    return packed, (exp + SCALE_BIAS).to(torch.uint8)


def _nearest(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """The index of the FP4 value nearest each element of x (int64, x's shape)."""
    return (x[..., None] - lut).abs().argmin(dim=-1)


def mxfp4_twin(src: Path, out: Path) -> tuple[Path, Path]:
    """(an MXFP4 checkpoint of the float gpt-oss `src`, its float twin), written under `out`."""
    from safetensors.torch import load_file, save_file

    from quantkit.format.mxfp4 import dequantize_stacked

    tensors = load_file(str(Path(src) / "model.safetensors"))
    packed, twin = {}, {}
    for key, t in tensors.items():
        name = key.rpartition(".")[2]
        if name in EXPERT_PROJECTIONS:  # [E, in, out] -> the blocks of [E, out, in]
            blocks, scales = encode(t.transpose(1, 2))
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
