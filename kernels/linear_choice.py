"""Which CPU kernel runs a quantized linear: one ordered table, the first row whose needs all hold wins, and each row
passed over says why (as vLLM's `choose_mp_linear_kernel` walks its kernels). `QuantLinear.repack_for_cpu` lays the
weight out for the row chosen, `int4_blocked_linear` reads from it where its dense tiles take over from the kernel,
and `quantkit env` prints the table with what each row needs on this CPU.

The rows, best first:
  W4A8 AMX        the W4A8 row's needs, AMX tiles granted and groups of whole 64-column tile steps: the same kernel
                  and bits, its products on AMX-INT8 tiles (kernels/csrc/int4_q8_amx.h) below the dense crossover
  W4A8            4-bit, bf16 activations, int8 activations asked (EngineConfig.cpu_int8_activations), the AVX-512
                  VNNI + VBMI kernel built, groups in fours; batches of a linear without bias or act-order go
                  straight to it (x rounded to int8 per row and group): every batch, prefill chunks too, unless
                  AMX tiles are granted (then decode-sized ones, the dense AMX tiles above)
  int4 AMX        4-bit, bf16 activations, AMX tiles granted, groups of whole 32-column tile steps
  int4 BF16       4-bit, bf16 activations, the AVX-512 BF16 kernel built, even groups
  W4A8 AVX2       4-bit, fp32 activations, int8 activations asked, groups in fours (built at every level): the
                  same rounding of x and integer sums as the AVX-512 W4A8 row, by vpmaddubsw
  int4 AVX2       4-bit, quantkit's int4 extension loaded (fp32 activations, or bf16 widened to fp32); below 4 rows
                  x in 16-bit fixed point per row and group (kernels/csrc/int4_x16_avx2.h), fp32 FMA tiles from there
  torch int4pack  4-bit where torch's CPU int4 kernel takes the weight (its group sizes, rows in 16s)
  int8            8-bit (torch's int8 weight-only kernel)
  dense           anything else: dequantized once, F.linear in the activations' dtype
Every quantkit int4 row shares one layout (int4_cpu.Int4Blocked); from `dense_from_m` rows on (prefill chunks) its
linear dequantizes tiles of the weight and multiplies densely, at the crossover measured for that row's kernel
(int4_cpu's DENSE_FROM_M constants).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from quantkit.kernels import int4_cpu


@dataclass(frozen=True)
class LinearCase:
    """What a quantized linear asks of the CPU: its weight format and the activations it is run with."""

    bits: int
    group_size: int
    dtype: torch.dtype  # the activations'
    bias: bool = False
    act_order: bool = False  # input columns permuted (GPTQ desc_act)
    int8_activations: bool = False  # W4A8 asked
    torch_int4: str | None = None  # why torch's int4pack kernel cannot take the weight (None: it can)


@dataclass(frozen=True)
class LinearKernel:
    """One row of the table."""

    name: str  # as `cpu_path` and `quantkit env` say it
    layout: str  # "int4 blocks" (quantkit's kernels), "torch int4pack", "int8", "dense"
    needs: tuple[Callable[[LinearCase], str | None], ...]  # each: None where it holds, else why not
    direct: str | None = None  # "q8", "bf16", "f32": decode-sized batches of that dtype call the kernel straight
    dense_from: Callable[[LinearCase], int | None] = lambda case: None  # rows from which dense tiles take over
    tiles: bool = False  # runs on AMX tiles where it runs (a prompt split by default keeps them: prompt_split_default)

    def unmet(self, case: LinearCase) -> str | None:
        """Why this row cannot run `case`, or None."""
        return next((why for need in self.needs if (why := need(case)) is not None), None)


@dataclass(frozen=True)
class Choice:
    kernel: LinearKernel
    dense_from_m: int | None
    direct: str | None  # the direct call the module makes (None: through int4_blocked_linear / torch)
    passed_over: tuple[str, ...]  # "name: why" for each row before the chosen one

    @property
    def cpu_path(self) -> str:
        return self.kernel.name


def _bits(n: int) -> Callable[[LinearCase], str | None]:
    return lambda case: None if case.bits == n else f"{case.bits}-bit weights"


def _activations(dtype: torch.dtype) -> Callable[[LinearCase], str | None]:
    return lambda case: None if case.dtype == dtype else f"{str(case.dtype).removeprefix('torch.')} activations"


_bf16, _fp32 = _activations(torch.bfloat16), _activations(torch.float32)


def _built(feature: str, what: str) -> Callable[[LinearCase], str | None]:
    def need(case: LinearCase) -> str | None:
        ext = int4_cpu.extension()
        if ext is None:
            return f"quantkit's int4 kernels: {int4_cpu.unavailable()}"
        return None if hasattr(ext, feature) else f"{what} not built at this CPU level"
    return need


def _groups_of(n: int) -> Callable[[LinearCase], str | None]:
    return lambda case: None if case.group_size % n == 0 else f"group size {case.group_size} not a multiple of {n}"


def _amx(case: LinearCase) -> str | None:
    ext = int4_cpu.extension()
    return None if ext is not None and hasattr(ext, "has_amx") and ext.has_amx() else "no AMX tiles granted"


def _q8_asked(case: LinearCase) -> str | None:
    return None if case.int8_activations else "int8 activations not asked"


def _plain(case: LinearCase) -> str | None:
    return "a bias or act-order (the W4A8 path is the direct call's)" if case.bias or case.act_order else None


def _loaded(case: LinearCase) -> str | None:
    why = int4_cpu.unavailable()
    return None if why is None else f"quantkit's int4 kernels: {why}"


def _torch_int4(case: LinearCase) -> str | None:
    return case.torch_int4


def _dense_bf16_kernel(amx: bool) -> Callable[[LinearCase], int]:
    return lambda case: int4_cpu.dense_threshold(torch.bfloat16, bf16_kernel=True, amx=amx)


def _dense_avx2(case: LinearCase) -> int:
    return int4_cpu.dense_threshold(case.dtype)


def _dense_q8_avx2(case: LinearCase) -> int:
    return int4_cpu.DENSE_FROM_M_Q8_AVX2


def _dense_q8(case: LinearCase) -> int:
    if _amx(case) is not None:
        return int4_cpu.NEVER_DENSE  # the VNNI kernel beats bf16 dense tiles at every M without AMX
    return int4_cpu.dense_threshold(torch.bfloat16, bf16_kernel=True, amx=case.group_size % 32 == 0)


INT4 = (_bits(4), _loaded)
BF16 = (*INT4, _bf16, _built("int4_linear_bf16", "the AVX-512 BF16 kernel"), _groups_of(2))
Q8 = (*BF16, _q8_asked, _plain, _built("int4_linear_q8", "the int8-activation kernel"), _groups_of(4))
TABLE: tuple[LinearKernel, ...] = (
    LinearKernel("int4 (quantkit AMX-INT8 int8-activation kernel)", "int4 blocks", (*Q8, _amx, _groups_of(64)),
                 direct="q8", dense_from=lambda case: int4_cpu.DENSE_FROM_M_Q8_AMX, tiles=True),
    LinearKernel("int4 (quantkit AVX-512 VNNI int8-activation kernel)", "int4 blocks", Q8, direct="q8",
                 dense_from=_dense_q8),
    LinearKernel("int4 (quantkit AMX + AVX-512 BF16 kernel)", "int4 blocks", (*BF16, _amx, _groups_of(32)),
                 direct="bf16", dense_from=_dense_bf16_kernel(True), tiles=True),
    LinearKernel("int4 (quantkit AVX-512 BF16 kernel)", "int4 blocks", BF16, direct="bf16",
                 dense_from=_dense_bf16_kernel(False)),
    LinearKernel("int4 (quantkit AVX2 int8-activation kernel)", "int4 blocks",
                 (*INT4, _fp32, _q8_asked, _plain, _built("int4_linear_q8_f32", "the AVX2 int8-activation kernel"),
                  _groups_of(4)), direct="q8", dense_from=_dense_q8_avx2),
    LinearKernel("int4 (quantkit AVX2 kernel)", "int4 blocks", INT4, direct="f32", dense_from=_dense_avx2),
    LinearKernel("int4 (torch int4pack)", "torch int4pack", (_bits(4), _torch_int4)),
    LinearKernel("int8", "int8", (_bits(8),)),
    LinearKernel("dense", "dense", ()),
)


def prompt_q8_unavailable(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why a step's prompt rows cannot run the W4A8 kernel for `dtype` activations on this CPU
    (EngineConfig.cpu_int8_prefill asked); None: they can."""
    ext = int4_cpu.extension()
    if ext is None:
        return f"quantkit's int4 kernels: {int4_cpu.unavailable()}"
    op = int4_cpu.direct_op("q8", dtype)
    if op is None:
        return f"no int8-activation kernel takes {str(dtype).removeprefix('torch.')} activations"
    if not hasattr(ext, op):
        return "the int8-activation kernel not built at this CPU level"
    return None


def prompt_q8_not_default(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why a step's prompt rows do not run the W4A8 kernel by default (EngineConfig.cpu_int8_prefill None): they
    cannot, or (bf16) AMX tiles are granted and the W4A8 kernel has no AMX-INT8 path here to run them on (the VNNI
    kernel is slower than the bf16 tiles). With it, a linear's prompt rows leave the tiles only for the W4A8 tiles
    (prompt_split_default: groups of whole 64s). fp32 prompts run W4A8 wherever the AVX2 int8-activation kernel
    builds: it is ahead of the fp32 kernel at every M. None: they do."""
    why = prompt_q8_unavailable(dtype)
    if why is None and dtype == torch.bfloat16 and _amx(LinearCase(4, 128, dtype)) is None \
            and not hasattr(int4_cpu.extension(), "int4_q8_amx_takes"):
        return "AMX tiles run prefill in bf16"
    return why


def prompt_split_default(own: Choice, q8: Choice) -> bool:
    """Whether, by default, a linear running `own` sends its prompt rows to `q8` (the W4A8 row chosen for it): not
    where that would take them off AMX tiles (the VNNI kernel runs slower than the bf16 tiles; the AMX-INT8 one
    faster: docs/BENCHMARKS.md "W4A8 prompts on AMX-INT8 tiles")."""
    return q8.kernel.tiles or not own.kernel.tiles


def choose(case: LinearCase) -> Choice:
    """The first row of TABLE that runs `case` (the last, dense, runs anything)."""
    return _choose(case, int4_cpu.extension(), int4_cpu.unavailable())


@lru_cache(maxsize=256)
def _choose(case: LinearCase, ext, unavailable: str | None) -> Choice:  # per extension: tests switch the CPU level
    passed = []
    for row in TABLE:
        why = row.unmet(case)
        if why is None:
            direct = row.direct if not (case.bias or case.act_order) and row.direct is not None \
                and int4_cpu.direct_op(row.direct, case.dtype) is not None else None
            return Choice(row, row.dense_from(case), direct, tuple(passed))
        passed.append(f"{row.name}: {why}")
    raise AssertionError("the dense row runs every case")


def int4_dense_from_m(dtype: torch.dtype, w: int4_cpu.Int4Blocked, bias: bool) -> int:
    """Where `int4_blocked_linear` on `w` switches from its kernel to dense tiles, for activations of `dtype`."""
    return choose(LinearCase(4, w.group_size, dtype, bias, w.perm is not None)).dense_from_m


def table_rows(case: LinearCase) -> list[tuple[str, str]]:
    """Each row of the table and what it says of `case` on this CPU: "chosen", "would run" (behind the chosen), or
    why not. What `quantkit env` prints for a typical layer."""
    chosen = choose(case).kernel
    out, seen = [], False
    for row in TABLE:
        why = row.unmet(case)
        seen = seen or row is chosen
        out.append((row.name, "chosen" if row is chosen else ("would run" if why is None and seen else why or "")))
    return out
