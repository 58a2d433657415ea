"""Writing a quantized checkpoint: safetensors shards (+ index), config.json with the
quantization_config that vLLM and transformers read, quantize_config.json, tokenizer files.

The shards themselves are streamed to disk as tensors come, layer by layer (quantkit.quant.shard_writer).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from quantkit.config import QuantizeConfig
from quantkit.format import compressed_tensors
from quantkit.format.packing import pack
from quantkit.format.primitives import QuantizedWeight

COPY_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)


def gptq_quantization_config(cfg: QuantizeConfig, skipped: list[str], fused: list[str] = ()) -> dict:
    """GPTQ quantization_config. vLLM requires bits, group_size, desc_act and sym; linears left float
    are GPTQModel-style negative `dynamic` rules, which vLLM matches (anchored at the start) against
    its module names, fused ones included (`fused`: e.g. model.layers.0.mlp.gate_up_proj), and are
    also listed in modules_to_not_convert for other readers."""
    fmt = cfg.layout  # "gptq" (v1) or "gptq_v2"
    qc = {
        "quant_method": "gptq", "bits": cfg.bits, "group_size": cfg.group_size, "desc_act": cfg.desc_act,
        "act_group_aware": cfg.act_group_aware, "sym": cfg.is_sym, "damp_percent": cfg.damp, "static_groups": cfg.static_groups,
        "true_sequential": cfg.true_sequential, "gptaq": cfg.gptaq, "checkpoint_format": fmt, "format": fmt, "lm_head": cfg.quantize_lm_head,
        "quantizer": f"quantkit:{_version()}", "method": cfg.method,
    }
    if skipped:
        qc["dynamic"] = {f"-:^{re.escape(name)}$": {} for name in [*skipped, *fused]}
        qc["modules_to_not_convert"] = list(skipped)
    return qc


def awq_quantization_config(cfg: QuantizeConfig, skipped: list[str]) -> dict:
    """AWQ GEMM quantization_config (AutoAWQ / transformers / vLLM). Zeros are always stored.

    modules_to_not_convert is never empty (lm_head stays float in every quantkit checkpoint):
    given an empty list, vLLM guesses it from the dtypes of every *.safetensors file in the
    folder, awq_plan.safetensors included, whose float entries would then switch off the
    matching linears (vLLM matches these names as substrings).
    """
    return {
        "quant_method": "awq", "bits": cfg.bits, "group_size": cfg.group_size, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": ["lm_head", *skipped],
        "quantizer": f"quantkit:{_version()}", "method": cfg.method,
    }


def ct_quantization_config(cfg: QuantizeConfig, skipped: list[str]) -> dict:
    """compressed-tensors pack-quantized, as llm-compressor writes it (lm_head and the float linears ignored).
    Act-order is recorded as actorder "weight" (static groups, no g_idx: QuantizeConfig sets them)."""
    actorder = "weight" if cfg.desc_act and cfg.group_size != -1 else None
    return compressed_tensors.quantization_config(cfg.bits, cfg.group_size, cfg.is_sym, actorder,
                                                  ["lm_head", *skipped])


def quantization_config(cfg: QuantizeConfig, skipped: list[str], fused: list[str] = ()) -> dict:
    if cfg.layout == "awq":
        return awq_quantization_config(cfg, skipped)
    if cfg.layout == "compressed-tensors":
        return ct_quantization_config(cfg, skipped)
    return gptq_quantization_config(cfg, skipped, fused)


def packed_tensors(qw: QuantizedWeight, layout: str, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized linear under `prefix`, in `layout`."""
    if layout == "compressed-tensors":
        return compressed_tensors.ct_tensors(qw, prefix)
    return pack(qw, layout).tensors(prefix)


def _version() -> str:
    from quantkit import __version__

    return __version__


def write_metadata(out_dir: Path, src_dir: Path, config_dict: dict, qconfig: dict, meta: dict) -> None:
    config = dict(config_dict)
    config["quantization_config"] = qconfig
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if qconfig["quant_method"] == "gptq":
        (out_dir / "quantize_config.json").write_text(json.dumps(qconfig, indent=2) + "\n")
    (out_dir / "quantkit_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    for name in COPY_FILES:
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, out_dir / name)
