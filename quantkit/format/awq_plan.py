"""The AWQ plan file: its name, its keys, and how it is saved and read.

AWQ's search (scales folded into the weights, clip thresholds) is saved beside the checkpoint as
`awq_plan.safetensors`, so a run can be audited (`quantkit check` undoes the folds with it) and
applied again without searching (`quantize --load-plan`). Keys, all fp32:
  layers.<i>.<group>.scale    [K]     the folded scale of a LinearGroup (e.g. `layers.0.qkv.scale`)
  layers.<i>.<linear>.clip    [N, G]  the clip threshold of a quantized linear (e.g. `layers.0.mlp.down_proj.clip`)
  layers.<i>.<linear>.gain    [N]     the gain each output row's scales were multiplied by (--awq-row-gain)
Groups that were not scaled (GQA v -> o, nothing to quantize) have no `.scale` key. The same
tensors give the same folded and clipped weights, so a checkpoint made from a loaded plan is bit
for bit the one the search made. The file is not a weight shard: checkpoint readers skip it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from quantkit.errors import QuantkitError

PLAN_FILE = "awq_plan.safetensors"
SCALE_SUFFIX = ".scale"
CLIP_SUFFIX = ".clip"
GAIN_SUFFIX = ".gain"
OPTIONAL_SUFFIXES = (CLIP_SUFFIX, GAIN_SUFFIX)  # keys a plan may lack (plans saved before quantkit wrote them)


def layer_prefix(index: int) -> str:
    return f"layers.{index}."


def scale_key(group: str) -> str:
    return group + SCALE_SUFFIX


def clip_key(linear: str) -> str:
    return linear + CLIP_SUFFIX


def gain_key(linear: str) -> str:
    return linear + GAIN_SUFFIX


def save_plan(plan: dict[str, torch.Tensor], path: Path) -> None:
    """Write a full plan (keys already prefixed `layers.<i>.`) as fp32, through a temporary file."""
    from safetensors.torch import save

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    # Serialized in memory (a plan is scales and clips, small) and written through open(), so the umask sets its
    # mode as it does the shards': safetensors' save_file creates its files 0600.
    tmp.write_bytes(save({k: v.detach().float().contiguous().cpu() for k, v in plan.items()}))
    os.replace(tmp, path)


def load_plan(path: Path, what: str = "AWQ plan") -> dict[str, torch.Tensor]:
    """Every tensor of a plan file; a missing or damaged file is a one-line QuantkitError naming `what`."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise QuantkitError(f"{what} {path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own SafetensorError for damaged files
        raise QuantkitError(f"{what} {path}: not a readable safetensors file ({exc})") from exc


class PlanFile:
    """A saved plan given to `--load-plan`, read one layer at a time and checked against what the model needs."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._tensors = load_plan(self.path, "--load-plan")

    def layer_count(self) -> int:
        indices = {int(k.split(".")[1]) for k in self._tensors if k.startswith("layers.")}
        return max(indices) + 1 if indices else 0

    def layer(self, index: int, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The plan of layer `index`, checked against `expected` (key -> shape); QuantkitError on mismatch.
        A clip or a gain may be absent: that linear is quantized unclipped or without a gain (plans saved before
        quantkit clipped q/k, or before it fitted row gains, have none); every scale must be there."""
        prefix = layer_prefix(index)
        found = {k[len(prefix):]: v for k, v in self._tensors.items() if k.startswith(prefix)}
        missing = sorted(k for k in set(expected) - set(found) if not k.endswith(OPTIONAL_SUFFIXES))
        extra = sorted(set(found) - set(expected))
        if missing or extra:
            what = f"lacks {prefix}{missing[0]}" if missing else f"has {prefix}{extra[0]}, which this run does not use"
            raise QuantkitError(f"--load-plan {self.path} does not match this model and settings: it {what}")
        for key, shape in expected.items():
            if key in found and tuple(found[key].shape) != tuple(shape):
                raise QuantkitError(f"--load-plan {self.path}: {prefix}{key} has shape {tuple(found[key].shape)}, "
                                    f"this model needs {tuple(shape)}")
        return {k: v.float() for k, v in found.items()}

    def check_layer_count(self, num_layers: int) -> None:
        if self.layer_count() != num_layers:
            raise QuantkitError(f"--load-plan {self.path} holds {self.layer_count()} layers; "
                                f"the model has {num_layers}")
