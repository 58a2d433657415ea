"""Writing a quantized checkpoint: safetensors shards (+ index), config.json with the
quantization_config that vLLM and transformers read, quantize_config.json, tokenizer files.

Tensors arrive layer by layer and are streamed to disk as they come (see ShardWriter), so the
writer holds one tensor at a time, not a shard.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import torch

from quantkit.config import QuantizeConfig
from quantkit.format import compressed_tensors
from quantkit.format.packing import pack
from quantkit.format.primitives import QuantizedWeight
from quantkit.model.checkpoint import SAFETENSORS_DTYPES

SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

COPY_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)


class ShardWriter:
    """Streams tensors into safetensors shards without holding a shard in memory.

    Each tensor's bytes go straight to the open shard's data file; its header entry is kept.
    When the next tensor would pass `max_shard_bytes`, the shard is closed: header, then the data
    copied after it in 1 MiB chunks. Memory use is one tensor at a time, whatever the shard size.
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._parts: list[tuple[Path, list[str]]] = []
        self._open: _OpenShard | None = None
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        # widest dtypes first, as safetensors orders them, so that offsets stay aligned
        for name, t in sorted(tensors.items(), key=lambda kv: -kv[1].element_size()):
            size = t.numel() * t.element_size()
            if self._open is not None and self._open.nbytes and self._open.nbytes + size > self.max_shard_bytes:
                self._close()
            if self._open is None:
                self._open = _OpenShard(self.out_dir / f"part-{len(self._parts):05d}.data.tmp")
            self._open.write(name, t)
            self.total_bytes += size

    def _close(self) -> None:
        part = self.out_dir / f"part-{len(self._parts):05d}.safetensors.tmp"
        keys = self._open.finish(part)
        self._parts.append((part, keys))
        self._open = None

    def finish(self) -> list[str]:
        """Name the shards model.safetensors or model-0000i-of-0000N.safetensors, and always write
        the index: loaders that glob *.safetensors (vLLM) then read only the files it names, not
        other safetensors files kept beside the weights (awq_plan.safetensors)."""
        if self._open is None and not self._parts:  # nothing was added: still one (empty) shard
            self._open = _OpenShard(self.out_dir / "part-00000.data.tmp")
        if self._open is not None:
            self._close()
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


class _OpenShard:
    """One shard being written: its data file and the header entries of what is in it."""

    def __init__(self, data_path: Path):
        self.data_path = data_path
        self._fh = open(data_path, "wb")
        self.header: dict[str, dict] = {}
        self.nbytes = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        self._fh.write(memoryview(raw))
        end = self.nbytes + t.numel() * t.element_size()
        self.header[name] = {"dtype": SAFETENSORS_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [self.nbytes, end]}
        self.nbytes = end

    def finish(self, part: Path) -> list[str]:
        """Write `part`: u64 header length, the JSON header padded to 8 bytes, then the data."""
        self._fh.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(part, "wb") as out, open(self.data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(data, out, 1 << 20)
        self.data_path.unlink()
        return list(self.header)


def gptq_quantization_config(cfg: QuantizeConfig, skipped: list[str], fused: list[str] = ()) -> dict:
    """GPTQ quantization_config. vLLM requires bits, group_size, desc_act and sym; linears left float
    are GPTQModel-style negative `dynamic` rules, which vLLM matches (anchored at the start) against
    its module names, fused ones included (`fused`: e.g. model.layers.0.mlp.gate_up_proj), and are
    also listed in modules_to_not_convert for other readers."""
    fmt = cfg.layout  # "gptq" (v1) or "gptq_v2"
    qc = {
        "quant_method": "gptq", "bits": cfg.bits, "group_size": cfg.group_size, "desc_act": cfg.desc_act,
        "act_group_aware": cfg.act_group_aware, "sym": cfg.is_sym, "damp_percent": cfg.damp, "static_groups": cfg.static_groups,
        "true_sequential": cfg.true_sequential, "checkpoint_format": fmt, "format": fmt, "lm_head": cfg.quantize_lm_head,
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
