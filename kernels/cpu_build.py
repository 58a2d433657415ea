"""What quantkit compiles for x86-64 CPUs: its C++ extensions, the instruction-set levels each one is built at, and
the flags of each level. Data and pure functions, standard library only: setup.py reads this file before quantkit
is installed, and the loader (cpu_ext.py) reads it at run time, so a wheel and a checkout build the same code.

A wheel carries every extension at every level (as ggml's GGML_CPU_ALL_VARIANTS builds one library per CPU level),
named `<extension>_<level>`; the loader imports the highest level that the CPU and the OS run (cpu_isa.py). The
levels are cumulative, each the one below plus the features it names:

  avx2         x86-64-v3: AVX2, FMA, F16C, BMI1/2 (Haswell, Zen 1 and later)
  avx512       x86-64-v4: AVX-512 F/BW/CD/DQ/VL (Skylake-SP, Cascade Lake, Ice Lake)
  avx512_bf16  + AVX-512 BF16, VNNI, VBMI (Zen 4 and 5, Sapphire Rapids and later with AMX off)
  amx          + AMX-TILE, AMX-BF16, AMX-INT8 (Sapphire Rapids, Emerald and Granite Rapids)

The sources pick their paths from the compiler's own macros (__AVX512BF16__, __AMX_TILE__, ...), so a level's flags
alone decide which paths an extension holds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
COMMON_CFLAGS = ("-O3", "-g0", "-fopenmp", "-std=c++17")  # -g0: no debug info (the wheel is 4x smaller)
LDFLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class Level:
    name: str
    cpu_flags: tuple[str, ...]  # as Linux names them in /proc/cpuinfo, this level's and every level's below
    cflags: tuple[str, ...]
    summary: str
    needs_amx_permission: bool = False  # Linux hands a process the tile data only when it asks (arch_prctl)


_V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
_BF16 = _V4 + ("avx512_bf16", "avx512_vnni", "avx512vbmi")
_BF16_CFLAGS = ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi")

LEVELS: tuple[Level, ...] = (  # lowest first
    Level("avx2", _V3, ("-march=x86-64-v3",), "AVX2 + FMA"),
    Level("avx512", _V4, ("-march=x86-64-v4",), "AVX-512 F/BW/VL"),
    Level("avx512_bf16", _BF16, _BF16_CFLAGS, "AVX-512 BF16 + VNNI"),
    Level("amx", _BF16 + ("amx_tile", "amx_bf16", "amx_int8"),
          _BF16_CFLAGS + ("-mamx-tile", "-mamx-bf16", "-mamx-int8"), "AMX tiles + AVX-512 BF16", True),
)
LEVEL_NAMES = tuple(level.name for level in LEVELS)


@dataclass(frozen=True)
class Extension:
    name: str  # the module is `<name>_<level>`
    sources: tuple[str, ...]  # file names under csrc/
    kernels: str  # what it holds, for `quantkit env`


EXTENSIONS: tuple[Extension, ...] = (
    Extension("quantkit_int4", ("int4_cpu.cpp", "moe_int4_cpu.cpp"), "4-bit linears and MoE experts, the int8 lm_head, W4A8"),
    Extension("quantkit_bf16", ("bf16_cpu.cpp",), "bf16 linears"),
    Extension("quantkit_attn", ("paged_attention_cpu.cpp", "fused_ops_cpu.cpp"), "paged attention, fused ops"),
    Extension("quantkit_stream", ("stream_read_cpu.cpp",), "the streaming read of the bandwidth bound"),
    Extension("quantkit_search", ("group_error_cpu.cpp",), "the scale search's candidate errors"),
)


def level_named(name: str) -> Level:
    for level in LEVELS:
        if level.name == name:
            return level
    raise KeyError(f"unknown CPU level {name!r}; expected one of {', '.join(LEVEL_NAMES)}")


def module_name(extension: str, level: str) -> str:
    return f"{extension}_{level}"


def cflags(level: Level) -> list[str]:
    return [*COMMON_CFLAGS, *level.cflags]


def source_digest(sources: tuple[str, ...], csrc: Path = CSRC) -> str:
    """A digest of an extension's sources and of every header beside them (any source may include any header):
    the version of its code, recorded beside a built module and compared at load."""
    digest = hashlib.sha256()
    for path in sorted({*(csrc / s for s in sources), *csrc.glob("*.h")}):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
