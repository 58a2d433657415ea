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


def auto_cpu_dtype(capabilities: dict | None = None) -> tuple[str, str]:
    """The CPU default dtype and why: bf16 where the CPU computes it natively (AVX-512 BF16 or AMX,
    as torch's cpuinfo reports), fp32 elsewhere (bf16 matmuls are then emulated and slower)."""
    caps = torch.cpu.get_capabilities() if capabilities is None else capabilities
    native = [name for name in ("avx512_bf16", "amx_bf16") if caps.get(name)]
    if native:
        return "bfloat16", f"the CPU computes bf16 natively ({', '.join(native)})"
    return "float32", "the CPU has neither AVX-512 BF16 nor AMX, so bf16 would be emulated"


COMPUTE_DTYPES = ("auto", "float32", "bfloat16")


def compute_dtype(name: str, device: torch.device, capabilities: dict | None = None) -> tuple[torch.dtype, str]:
    """The dtype of the forward passes that feed a quantizer (`auto`, `float32` or `bfloat16`) and why.

    `auto`: bf16 on a CUDA device that supports it and on a CPU that computes it natively (as
    auto_cpu_dtype), else fp32. The quantizers' own math (Hessians, GPTQ's solve, AWQ's clip
    search) and the weights they read stay fp32 whatever this says."""
    if name == "float32":
        return torch.float32, "asked for (--compute-dtype float32)"
    if name == "bfloat16":
        return torch.bfloat16, "asked for (--compute-dtype bfloat16)"
    if name != "auto":
        raise QuantkitError(f"unknown compute dtype {name!r}; expected one of {', '.join(COMPUTE_DTYPES)}")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "the GPU supports bf16"
        return torch.float32, "the GPU has no bf16"
    dtype, why = auto_cpu_dtype(capabilities)
    return (torch.bfloat16 if dtype == "bfloat16" else torch.float32), why
