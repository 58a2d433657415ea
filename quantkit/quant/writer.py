"""Writing a quantized checkpoint: safetensors shards (+ index), config.json with the
quantization_config that vLLM and transformers read, quantize_config.json, tokenizer files.

Tensors arrive layer by layer and are flushed to a shard whenever the buffer passes
`max_shard_bytes`, so the writer never holds more than one shard in memory.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantkit.config import QuantizeConfig

COPY_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)


class ShardWriter:
    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._parts: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            size = t.numel() * t.element_size()
            if self._buffer and self._buffer_bytes + size > self.max_shard_bytes:
                self._flush()
            self._buffer[name] = t.detach().cpu().contiguous()
            self._buffer_bytes += size
            self.total_bytes += size

    def _flush(self) -> None:
        part = self.out_dir / f"part-{len(self._parts):05d}.safetensors.tmp"
        save_file(self._buffer, str(part), metadata={"format": "pt"})
        self._parts.append((part, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def finish(self) -> list[str]:
        """Name the shards model.safetensors or model-0000i-of-0000N.safetensors, and always write
        the index: loaders that glob *.safetensors (vLLM) then read only the files it names, not
        other safetensors files kept beside the weights (awq_plan.safetensors)."""
        if self._buffer or not self._parts:
            self._flush()
        n = len(self._parts)
        weight_map, names = {}, []
        for i, (part, keys) in enumerate(self._parts, 1):
            name = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            part.rename(self.out_dir / name)
            names.append(name)
            weight_map.update({k: name for k in keys})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return names


def gptq_quantization_config(cfg: QuantizeConfig, skipped: list[str], fused: list[str] = ()) -> dict:
    """GPTQ quantization_config. vLLM requires bits, group_size, desc_act and sym; linears left float
    are GPTQModel-style negative `dynamic` rules, which vLLM matches (anchored at the start) against
    its module names, fused ones included (`fused`: e.g. model.layers.0.mlp.gate_up_proj), and are
    also listed in modules_to_not_convert for other readers."""
    fmt = cfg.layout  # "gptq" (v1) or "gptq_v2"
    qc = {
        "quant_method": "gptq", "bits": cfg.bits, "group_size": cfg.group_size, "desc_act": cfg.desc_act,
        "sym": cfg.is_sym, "damp_percent": cfg.damp, "static_groups": cfg.static_groups,
        "true_sequential": cfg.true_sequential, "checkpoint_format": fmt, "format": fmt, "lm_head": False,
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


def quantization_config(cfg: QuantizeConfig, skipped: list[str], fused: list[str] = ()) -> dict:
    if cfg.layout == "awq":
        return awq_quantization_config(cfg, skipped)
    return gptq_quantization_config(cfg, skipped, fused)


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
