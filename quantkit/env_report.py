"""What this machine and install give quantkit, as `vllm collect-env` and llama.cpp's system_info line do: versions, the
CPU and the level its kernels run at (and why), each CPU kernel on or off (and why), threads, GPUs.

`collect()` reads it all into an `EnvReport`; `quantkit env` prints it (`--json` for scripts).
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from dataclasses import asdict, dataclass, field

from quantkit import __version__


@dataclass
class EnvReport:
    versions: dict[str, str]  # package -> version ("not installed")
    python: str
    platform: str
    cpu_model: str
    cpu_level: str  # the level the kernels run at ("none": torch's ops)
    cpu_level_why: str
    machine_level: str  # the highest level this CPU and OS run
    cpu_flags: dict[str, bool]  # every feature some level needs -> present
    amx_granted: bool
    threads: int  # torch's intra-op threads
    kernels: list[dict]  # cpu_status.KernelStatus as dicts
    kernel_files: dict[str, str]  # extension -> where its module came from ("wheel: PATH", "build cache: PATH")
    gpus: list[str] = field(default_factory=list)
    # kernels/linear_choice.py's table for a 4-bit g128 linear without bias: activations -> [(row, verdict)]
    linear_choice: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    # the prompt tokens of a 4-bit checkpoint by default, per activations ("bfloat16", "float32"): "W4A8" or
    # "W4A16 (why)" (EngineConfig.cpu_int8_prefill)
    prompt_arithmetic: dict[str, str] = field(default_factory=dict)
    # where the engine holds its weights on CPU by default: "transparent huge pages" or "4 KiB pages (why)"
    weight_pages: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


PACKAGES = ("quantkit", "torch", "transformers", "triton", "safetensors", "compressed-tensors", "lm-eval", "fastapi")


def package_version(name: str) -> str:
    if name == "quantkit":
        return __version__
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [f"{i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]


def collect() -> EnvReport:
    import torch

    from quantkit.kernels import cpu_ext, cpu_isa, cpu_status
    from quantkit.kernels.cpu_build import EXTENSIONS, LEVELS

    choice = cpu_isa.selected()
    flags = cpu_isa.cpu_flags()
    wanted = sorted({f for level in LEVELS for f in level.cpu_flags})
    kernels = cpu_status.kernel_statuses()
    files = {}
    for ext in EXTENSIONS:  # every extension, also those no decode step loads (the streaming read of `bandwidth`)
        cpu_ext.load_cpu_extension(ext.name, ext.sources)
        loaded = cpu_ext.loaded_from(ext.name)
        files[ext.name] = f"{loaded.origin}: {loaded.path}" if loaded else "not loaded"
    return EnvReport(
        versions={name: package_version(name) for name in PACKAGES},
        python=sys.version.split()[0], platform=platform.platform(), cpu_model=cpu_model(),
        cpu_level=cpu_ext.active_level().name if cpu_ext.active_level() else "none", cpu_level_why=cpu_ext.level_reason(),
        machine_level=choice.machine.name if choice.machine else "none",
        cpu_flags={f: f in flags for f in wanted}, amx_granted=cpu_isa.request_amx(),
        threads=torch.get_num_threads(), kernels=cpu_status.as_dicts(kernels), kernel_files=files, gpus=gpus(),
        linear_choice=linear_choices(), prompt_arithmetic=prompt_arithmetic(), weight_pages=weight_pages())


def weight_pages() -> str:
    """Where the engine's weights go on this machine by default (EngineConfig.cpu_huge_pages)."""
    from quantkit.engine.huge_pages import thp_unavailable

    why = thp_unavailable()
    return "transparent huge pages" if why is None else f"4 KiB pages ({why})"


def prompt_arithmetic() -> dict[str, str]:
    """How the engine computes a 4-bit checkpoint's prompt tokens on this CPU by default, in bf16 and in fp32."""
    import torch

    from quantkit.kernels.linear_choice import prompt_q8_not_default

    whys = {dtype: prompt_q8_not_default(dtype) for dtype in (torch.bfloat16, torch.float32)}
    return {str(dtype).removeprefix("torch."): "W4A8" if why is None else f"W4A16 ({why})"
            for dtype, why in whys.items()}


def linear_choices() -> dict[str, list[tuple[str, str]]]:
    """The linear kernel table's verdict on a 4-bit, group-128 linear without bias, in bf16 and in fp32."""
    import torch

    from quantkit.kernels.linear_choice import LinearCase, table_rows

    return {str(dtype).removeprefix("torch."): table_rows(LinearCase(4, 128, dtype)) for dtype in
            (torch.bfloat16, torch.float32)}
