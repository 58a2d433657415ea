"""Which of the CPU levels (cpu_build.LEVELS) this process runs its C++ kernels at, and why.

The highest level whose features the CPU reports (Linux's /proc/cpuinfo flags, which leave out what the OS does not
enable) and, for AMX, whose tile data Linux grants this process (arch_prctl ARCH_REQ_XCOMP_PERM), capped by
QUANTKIT_CPU_ISA:

  QUANTKIT_CPU_ISA=avx2|avx512|avx512_bf16|amx   at most this level (never above what the CPU runs)
  QUANTKIT_CPU_ISA=none                          no C++ kernels: torch's ops everywhere

A CPU below the lowest level, another OS or architecture, or an unknown value keeps torch's ops, and `why` says so.
`choose` is the pure rule; `selected()` applies it to this machine and environment once per process.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from dataclasses import dataclass

from quantkit.kernels.cpu_build import LEVEL_NAMES, LEVELS, Level

ENV = "QUANTKIT_CPU_ISA"
NONE = "none"


@dataclass(frozen=True)
class Choice:
    level: Level | None  # None: torch's ops
    machine: Level | None  # the highest level this CPU and OS run
    why: str  # one line

    @property
    def name(self) -> str:
        return self.level.name if self.level is not None else NONE


def runnable_levels(flags: frozenset[str], amx_permitted: bool) -> tuple[Level, ...]:
    """The levels whose every feature is in `flags` (and, for AMX, whose tiles the OS grants), lowest first."""
    return tuple(lv for lv in LEVELS if set(lv.cpu_flags) <= flags and (amx_permitted or not lv.needs_amx_permission))


def choose(runnable: tuple[Level, ...], requested: str | None, amx_note: str = "") -> Choice:
    """The level to run at: the highest runnable one, at most `requested` (QUANTKIT_CPU_ISA's value, or None)."""
    machine = runnable[-1] if runnable else None
    top = f"{machine.name} ({machine.summary})" if machine else "none"
    if requested is not None and requested.strip():
        want = requested.strip().lower()
        if want == NONE:
            return Choice(None, machine, f"{ENV}=none: torch's ops")
        if want not in LEVEL_NAMES:
            return Choice(None, machine, f"{ENV}={requested!r} is not one of {', '.join((*LEVEL_NAMES, NONE))}: "
                                         f"torch's ops")
        capped = [lv for lv in runnable if LEVEL_NAMES.index(lv.name) <= LEVEL_NAMES.index(want)]
        if not capped:
            return Choice(None, machine, f"{ENV}={want}, but this CPU runs none of the levels: torch's ops")
        level = capped[-1]
        if level.name != want:
            return Choice(level, machine, f"{ENV}={want} is above what this CPU runs ({top})")
        return Choice(level, machine, f"{ENV}={want}; this CPU runs up to {top}")
    if machine is None:
        return Choice(None, None, f"this CPU has no AVX2 + FMA (the lowest level quantkit builds): torch's ops")
    return Choice(machine, machine, f"the highest level this CPU runs: {machine.summary}{amx_note}")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty off Linux or x86-64)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def request_amx() -> bool:
    """Ask Linux for the AMX tile data (a no-op where it was granted); False where it is refused or absent."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def selected() -> Choice:
    """This process's level (read once: the loaded extensions stay what they are)."""
    return detect(os.environ.get(ENV))


def detect(requested: str | None) -> Choice:
    if platform.machine() not in ("x86_64", "AMD64"):
        return Choice(None, None, f"{platform.machine()} is not x86-64: torch's ops")
    flags = cpu_flags()
    has_tiles = {"amx_tile", "amx_bf16", "amx_int8"} <= flags
    permitted = has_tiles and request_amx()
    note = " (the CPU has AMX, but Linux did not grant the tiles)" if has_tiles and not permitted else ""
    return choose(runnable_levels(flags, permitted), requested, note)
