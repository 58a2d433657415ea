"""The AWQ plan: the scales and clips of one run, saved as `awq_plan.safetensors`.

Keys of one layer, as the method returns them (the pipeline prefixes `layers.<i>.`):
  <group>.scale    fp32 [K]     the folded scale of a LinearGroup (e.g. `qkv.scale`)
  <linear>.clip    fp32 [N, G]  the clip threshold of a quantized linear (e.g. `mlp.down_proj.clip`)
Groups that were not scaled (GQA v -> o, nothing to quantize) have no `.scale` key.
`--load-plan` reads the file back and applies it without searching: the same tensors give the
same folded and clipped weights, so the checkpoint is bit for bit the same.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.errors import QuantkitError

SCALE_SUFFIX = ".scale"
CLIP_SUFFIX = ".clip"


def layer_prefix(index: int) -> str:
    return f"layers.{index}."


def scale_key(group: str) -> str:
    return group + SCALE_SUFFIX


def clip_key(linear: str) -> str:
    return linear + CLIP_SUFFIX


class PlanFile:
    """A saved plan, read one layer at a time and checked against what the model needs."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise QuantkitError(f"--load-plan {self.path}: no such file")
        try:
            with safe_open(str(self.path), framework="pt") as f:
                self._tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises its own SafetensorError for damaged files
            raise QuantkitError(f"--load-plan {self.path}: not a readable safetensors file ({exc})") from exc

    def layer_count(self) -> int:
        indices = {int(k.split(".")[1]) for k in self._tensors if k.startswith("layers.")}
        return max(indices) + 1 if indices else 0

    def layer(self, index: int, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The plan of layer `index`, checked against `expected` (key -> shape); QuantkitError on mismatch."""
        prefix = layer_prefix(index)
        found = {k[len(prefix):]: v for k, v in self._tensors.items() if k.startswith(prefix)}
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        if missing or extra:
            what = f"lacks {prefix}{missing[0]}" if missing else f"has {prefix}{extra[0]}, which this run does not use"
            raise QuantkitError(f"--load-plan {self.path} does not match this model and settings: it {what}")
        for key, shape in expected.items():
            if tuple(found[key].shape) != tuple(shape):
                raise QuantkitError(f"--load-plan {self.path}: {prefix}{key} has shape {tuple(found[key].shape)}, "
                                    f"this model needs {tuple(shape)}")
        return {k: v.float() for k, v in found.items()}

    def check_layer_count(self, num_layers: int) -> None:
        if self.layer_count() != num_layers:
            raise QuantkitError(f"--load-plan {self.path} holds {self.layer_count()} layers; "
                                f"the model has {num_layers}")


def save_plan(plan: dict[str, torch.Tensor], path: Path) -> None:
    """Write a full plan (keys already prefixed `layers.<i>.`); the pipeline normally does this."""
    from safetensors.torch import save_file

    save_file({k: v.detach().float().contiguous().cpu() for k, v in plan.items()}, str(path))
