"""Corrupted copies of a checkpoint: one tensor changed, everything else as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def corrupt(src: Path, dst: Path, key: str, fn) -> Path:
    """A copy of the single-file checkpoint `src` at `dst` with tensor `key` replaced by fn(tensor)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors[key] = fn(tensors[key])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def nan_every_seventh(t: torch.Tensor) -> torch.Tensor:
    """Every seventh element NaN: a scale tensor with bad groups, a norm whose NaN reaches every logit."""
    t = t.clone()
    t.view(-1)[::7] = float("nan")
    return t
