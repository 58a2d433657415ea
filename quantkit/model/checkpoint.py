"""Reading Hugging Face checkpoints: resolve a folder or hub id, read safetensors shards lazily.

`ShardReader` memory-maps the shards and hands out one tensor at a time, so the quantize
pipeline can hold a single decoder layer in memory while the rest stays on disk.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from quantkit.errors import QuantkitError

NOT_WEIGHT_FILES = ("awq_plan.safetensors",)
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken"]


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def resolve_model_path(name: str) -> Path:
    """A local checkpoint folder, or a hub id downloaded into the HF cache (safetensors only)."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise QuantkitError(f"{name}: not a folder (expected a Hugging Face checkpoint folder)")
        if not (path / "config.json").is_file():
            raise QuantkitError(f"{name}: no config.json in this folder; is it a Hugging Face checkpoint?")
        return path
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise QuantkitError(f"{name}: no such folder")
    if hub_offline():
        raise QuantkitError(f"{name}: not a local folder, and the Hugging Face hub is offline (HF_HUB_OFFLINE=1)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=WEIGHT_PATTERNS))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise QuantkitError(f"{name}: could not download from the Hugging Face hub ({type(exc).__name__})") from exc


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise QuantkitError(f"{path / 'config.json'}: unreadable ({exc})") from exc


def check_safetensors_file(file: Path) -> None:
    """Fail with one line when a safetensors file is corrupt or truncated (header vs. file size)."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(fh.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise QuantkitError(f"{file}: corrupt safetensors file ({exc})") from exc
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise QuantkitError(f"{file}: truncated safetensors file ({size} bytes, header says {8 + header_len + end})")


class ShardReader:
    """Lazy access to the tensors of a checkpoint folder (single file or sharded with an index)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            # awq_plan.safetensors (AWQ's saved scales and clips) sits beside the weights but is not one
            files = sorted(p.name for p in self.path.glob("*.safetensors") if p.name not in NOT_WEIGHT_FILES)
            if not files:
                bins = list(self.path.glob("*.bin"))
                hint = " (only PyTorch .bin weights found; convert them to safetensors)" if bins else ""
                raise QuantkitError(f"{self.path}: no .safetensors weights{hint}")
            weight_map = {}
        self._handles = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise QuantkitError(f"{file}: listed in the index but missing")
            check_safetensors_file(file)
            try:
                handle = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise QuantkitError(f"{file}: corrupt safetensors file ({exc})") from exc
            self._handles[name] = handle
            for key in handle.keys():
                weight_map.setdefault(key, name)
        self.weight_map: dict[str, str] = weight_map

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._handles[self.weight_map[key]].get_tensor(key)
        except KeyError as exc:
            raise QuantkitError(f"{self.path}: tensor {key} is missing from the checkpoint") from exc
        except SafetensorError as exc:
            raise QuantkitError(f"{self.path}: cannot read tensor {key} ({exc})") from exc

    def dtype_of(self, key: str) -> torch.dtype:
        return self.get(key).dtype

    def with_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        """All tensors under `prefix.` with the prefix stripped."""
        p = prefix + "."
        return {k[len(p):]: self.get(k) for k in self.weight_map if k.startswith(p)}

    def total_bytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in self._handles)
