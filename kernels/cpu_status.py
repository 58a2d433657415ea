"""Which of quantkit's C++ CPU kernels this process runs, and why not where it does not: what `quantkit env` prints and
the engine's start-up line says. Loading a kernel here is the same load the engine does (cpu_ext), so the answer is
the one the engine gets."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from quantkit.kernels import cpu_ext
from quantkit.kernels.cpu_build import EXTENSIONS


@dataclass(frozen=True)
class KernelStatus:
    kernel: str  # what it computes
    active: bool
    detail: str  # the path it takes where active, else why it is not
    extension: str  # the module it lives in


def _amx(module) -> bool:
    return hasattr(module, "has_amx") and bool(module.has_amx())


def _status(kernel: str, extension: str, module, feature: str | None, active_detail: str, missing: str
            ) -> KernelStatus:
    """Active when `module` loaded and (if named) has `feature`; else why not."""
    if module is None:
        return KernelStatus(kernel, False, cpu_ext.cpu_extension_unavailable(extension) or "not loaded", extension)
    if feature is not None and not hasattr(module, feature):
        return KernelStatus(kernel, False, missing, extension)
    return KernelStatus(kernel, True, active_detail, extension)


def kernel_statuses() -> list[KernelStatus]:
    """Every CPU kernel, in the order a decode step meets them."""
    sources = {ext.name: ext.sources for ext in EXTENSIONS}
    int4 = cpu_ext.load_cpu_extension("quantkit_int4", sources["quantkit_int4"])
    bf16 = cpu_ext.load_cpu_extension("quantkit_bf16", sources["quantkit_bf16"])
    attn = cpu_ext.load_cpu_extension("quantkit_attn", sources["quantkit_attn"])
    below = "needs the avx512_bf16 level (AVX-512 BF16 + VNNI)"
    int4_path = ("AMX tiles + AVX-512 BF16" if _amx(int4) else "AVX-512 BF16 (bf16 activations), AVX2 (fp32)"
                 ) if hasattr(int4, "int4_linear_bf16") else "AVX2 + FMA (fp32 activations)"
    bf16_path = (("AMX tiles" if _amx(bf16) else "AVX-512 BF16") + " (bf16 models' linears)"
                 ) if bf16 is not None and bf16.has_bf16_dot() else "fp32 widening (the lm_head of fp32 models)"
    level = cpu_ext.active_level()
    avx512 = level is not None and "avx512bw" in level.cpu_flags  # vec_avx512.h's paths are in from that level
    attn_path = ("AMX tiles for many-row steps, AVX-512 otherwise" if _amx(attn) else
                 "AVX-512" if avx512 else "portable loops (auto-vectorized for AVX2)")
    return [
        _status("int4 linear", "quantkit_int4", int4, None, int4_path, ""),
        _status("bf16 linear", "quantkit_bf16", bf16, None, bf16_path, ""),
        _status("int8 lm_head", "quantkit_int4", int4, "int8_linear_f32",
                ("AMX-INT8" if _amx(int4) else "AVX-512 VNNI") + " (bf16), AVX2 (fp32)"
                if hasattr(int4, "int8_linear_bf16") else "AVX2 (fp32 activations)", ""),
        _status("W4A8 linear", "quantkit_int4", int4, "int4_linear_q8", "AVX-512 VNNI + VBMI",
                "needs the avx512_bf16 level (AVX-512 VNNI + VBMI + BF16)"),
        _status("paged attention", "quantkit_attn", attn, None, attn_path, ""),
        _status("fused ops", "quantkit_attn", attn, None, "RMSNorm, SiLU-and-mul, RoPE + cache write, argmax", ""),
    ]


def as_dicts(statuses: list[KernelStatus]) -> list[dict]:
    return [asdict(s) for s in statuses]


def one_line(statuses: list[KernelStatus]) -> str:
    """The engine's start-up line: level, then each kernel on or off."""
    level = cpu_ext.active_level()
    parts = [f"{s.kernel} {'on' if s.active else 'off'}" for s in statuses]
    return f"CPU kernels at {level.name if level else 'none'} ({cpu_ext.level_reason()}): {', '.join(parts)}"
