"""Device names: the one place where `auto`, `cpu`, `cuda` or `cuda:N` becomes a torch.device.

Config objects call `check_device_name` when they are built (syntax only, so a config can be
made and validated on a machine without the device); the code that places tensors calls
`resolve_device`, which also checks that the device is there.
"""

from __future__ import annotations

import re

import torch

from quantkit.errors import QuantkitError

EXPECTED = "auto, cpu, cuda or cuda:N"
_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(name: str) -> None:
    """Raise a one-line QuantkitError unless `name` is auto, cpu, cuda or cuda:N."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise QuantkitError(f"unknown device {name!r}; expected {EXPECTED}")


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when torch sees one, else cpu; `cuda`/`cuda:N` checked against what is present."""
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise QuantkitError(f"device {name}: torch sees no CUDA device on this machine")
    device = torch.device(name)
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise QuantkitError(f"device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device
