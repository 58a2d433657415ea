"""Launcher for the Triton W4A16 kernels: check, allocate, launch.

The kernels live in quantkit.kernels.triton_w4a16_jit; their pure-torch reference (the test
oracle and the CPU serving path) is quantkit.kernels.reference.w4a16_matmul_reference.

On CUDA tensors the autotuned kernels run compiled. On CPU tensors (or with TRITON_INTERPRET=1)
they run in Triton's interpreter. `@triton.jit` reads TRITON_INTERPRET once, when it decorates,
so `kernel_module` keeps a private copy of the kernel module for the mode the import did not
give (built on first use): both paths work whatever imported triton or the kernels first.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import weakref
from dataclasses import dataclass
from types import ModuleType

import torch

from quantkit.errors import QuantkitError

KERNEL_MODULE = "quantkit.kernels.triton_w4a16_jit"
DECODE_MAX_M = 16  # at or below: the split-K kernel (one 16-row tile holds every row of x)
LAYOUT_IDS = {"gptq": 0, "gptq_v2": 1, "awq": 2}


@dataclass(frozen=True)
class TileConfig:
    """Fixed tiling for when the autotuner does not run (the interpreter, or autotune=False)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    split_k: int = 2
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_TILES = TileConfig()  # compiled kernels with autotune=False
# The interpreter's cost grows with programs x K steps, not with tile size: large tiles.
INTERPRETER_TILES = TileConfig(block_m=64, block_n=128, block_k=128, split_k=2)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _require_triton() -> None:
    if not triton_available():
        raise QuantkitError("the Triton backend needs triton: pip install 'quantkit[gpu]' (or pip install triton)")


@functools.cache
def kernel_module(interpret: bool) -> ModuleType:
    """The kernel module with its @triton.jit functions interpreted (True) or compiled (False).

    The import decorates them in the mode TRITON_INTERPRET names at that moment; the other mode
    is a private copy of the module, executed with the variable set accordingly.
    """
    _require_triton()
    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module(KERNEL_MODULE)
    if isinstance(module.gemm_kernel, InterpretedFunction) == interpret:
        return module
    return private_copy(KERNEL_MODULE, interpret)


def private_copy(module_name: str, interpret: bool) -> ModuleType:
    """A fresh copy of `module_name` (not in sys.modules) whose @triton.jit functions were decorated
    with TRITON_INTERPRET set to `interpret`; the variable is restored afterwards."""
    suffix = "_interpreted" if interpret else "_compiled"
    origin = importlib.util.find_spec(module_name).origin
    spec = importlib.util.spec_from_file_location(module_name + suffix, origin)
    copy = importlib.util.module_from_spec(spec)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec.loader.exec_module(copy)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return copy


def runs_compiled(device: torch.device) -> bool:
    """True when kernels for `device` are compiled; False when they run in the interpreter."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def kernels_for(device: torch.device) -> ModuleType:
    """The kernel module that runs on `device`: compiled for CUDA, interpreted otherwise."""
    return kernel_module(interpret=not runs_compiled(device))


# (id, version) of a g_idx tensor -> whether it is the trivial arange(K) // group_size
# (GPTQModel writes one even without act-order). An entry is dropped when its tensor is
# collected, so a new tensor at a recycled id never gets an old answer; the version counter
# catches in-place updates.
_TRIVIAL_G_IDX: dict[tuple[int, int, int], bool] = {}


def _effective_g_idx(g_idx: torch.Tensor | None, k: int, group_size: int) -> torch.Tensor | None:
    """None when g_idx only restates the default grouping (so the kernel can load groups by block)."""
    if g_idx is None:
        return None
    key = (id(g_idx), g_idx._version, group_size)
    known = _TRIVIAL_G_IDX.get(key)
    if known is None:
        default = torch.arange(k, device=g_idx.device) // group_size
        known = bool(torch.equal(g_idx.long(), default))
        _TRIVIAL_G_IDX[key] = known
        weakref.finalize(g_idx, _TRIVIAL_G_IDX.pop, key, None)
    return None if known else g_idx.to(torch.int32).contiguous()


def _check(x, qweight, qzeros, scales, layout, group_size, g_idx, bias) -> tuple[int, int, int]:
    """(M, N, K) after checking every shape against the layout; ValueError on a mismatch."""
    if layout not in LAYOUT_IDS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {tuple(LAYOUT_IDS)}")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    m, k = x.shape
    n = scales.shape[1]
    others = [t for t in (qweight, qzeros, scales, g_idx, bias) if t is not None]
    if any(t.device != x.device for t in others):
        raise ValueError(f"x is on {x.device} but a weight tensor is on {[t.device for t in others]}")
    packed_shape = (k, n // 8) if layout == "awq" else (k // 8, n)
    if k % 8 and layout != "awq":
        raise ValueError(f"K={k} is not a multiple of 8 (the GPTQ layout packs 8 rows a word)")
    if n % 8:
        raise ValueError(f"N={n} is not a multiple of 8 (zeros pack 8 columns a word)")
    if tuple(qweight.shape) != packed_shape or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 {packed_shape} for x {tuple(x.shape)}, layout {layout}; "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    groups = scales.shape[0]
    if tuple(qzeros.shape) != (groups, n // 8) or qzeros.dtype != torch.int32:
        raise ValueError(f"qzeros must be int32 {(groups, n // 8)}, got {qzeros.dtype} {tuple(qzeros.shape)}")
    if g_idx is None and groups != -(-k // group_size):
        raise ValueError(f"scales hold {groups} groups; K={k} at group size {group_size} needs {-(-k // group_size)}")
    if g_idx is not None and (layout == "awq" or g_idx.numel() != k):
        raise ValueError("g_idx is for the GPTQ layouts and must hold one group per input row")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias must have {n} elements, got {bias.numel()}")
    return m, n, k


def w4a16_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    *,
    layout: str,
    group_size: int = 128,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    autotune: bool | None = None,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ W_hat.T (+ bias) -> [M, N] in x's dtype, through the Triton kernels.

    qweight/qzeros/scales (and g_idx for the GPTQ layouts) exactly as stored on disk, on x's
    device. autotune: None = on CUDA only. Without autotuning, `tiles` fixes the tiling
    (default: DEFAULT_TILES compiled, INTERPRETER_TILES in the interpreter).
    """
    group_size = x.shape[-1] if group_size == -1 else group_size
    m, n, k = _check(x, qweight, qzeros, scales, layout, group_size, g_idx, bias)
    g = _effective_g_idx(g_idx, k, group_size)
    mod = kernels_for(x.device)
    tune = x.is_cuda if autotune is None else autotune
    if tiles is None:
        tiles = DEFAULT_TILES if runs_compiled(x.device) else INTERPRETER_TILES
    decode = m <= DECODE_MAX_M
    split = decode and _wants_split_k(n, x.device, tune, tiles)
    out = torch.zeros((m, n), device=x.device, dtype=torch.float32) if split \
        else torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out.to(x.dtype)
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    bias_arg = bias.contiguous() if bias is not None else scales  # any pointer; unread without HAS_BIAS
    args = (x, qweight, qzeros, scales, g if g is not None else qweight, bias_arg, out,
            m, n, k, triton_next_pow2(m),
            x.stride(0), x.stride(1), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0))
    meta = dict(GROUP_SIZE=group_size, LAYOUT=LAYOUT_IDS[layout], HAS_G_IDX=g is not None,
                HAS_BIAS=bias is not None, FP32_DOT=not runs_compiled(x.device) or x.dtype == torch.float32)
    if decode:
        _launch_splitk(mod, args, meta, n, split, tune, tiles)
        return out.to(x.dtype) if split and x.dtype != torch.float32 else out
    _launch_gemm(mod, args, meta, m, n, tune, tiles)
    return out


def triton_next_pow2(m: int) -> int:
    """The autotuner's M bucket: the next power of two (so every batch size does not re-tune)."""
    return 1 << max(0, (m - 1).bit_length())


def _launch_gemm(mod: ModuleType, args: tuple, meta: dict, m: int, n: int, tune: bool, tiles: TileConfig) -> None:
    def grid(cfg):
        return (-(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"]),)

    if tune:
        mod.gemm_kernel_tuned[grid](*args, **meta)
        return
    cfg = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m)
    mod.gemm_kernel[grid(cfg)](*args, **meta, **cfg, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _launch_splitk(mod: ModuleType, args: tuple, meta: dict, n: int, split: bool, tune: bool,
                   tiles: TileConfig) -> None:
    def grid(cfg):
        return (-(-n // cfg["BLOCK_N"]), cfg["SPLIT_K"])

    if tune:
        kernel = mod.splitk_kernel_tuned if split else mod.gemv_kernel_tuned
        kernel[grid](*args, **meta, BLOCK_M=DECODE_MAX_M)
        return
    cfg = dict(BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k if split else 1)
    mod.splitk_kernel[grid(cfg)](*args, **meta, **cfg, BLOCK_M=DECODE_MAX_M,
                                 num_warps=tiles.num_warps, num_stages=tiles.num_stages)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _wants_split_k(n: int, device: torch.device, tune: bool, tiles: TileConfig) -> bool:
    """Split K across programs when the N tiles alone cannot fill the GPU.

    Splitting costs an fp32 buffer, a memset and a cast (three launches instead of one), so it
    only pays when N / 64 tiles would leave streaming multiprocessors idle. Without tuning, the
    fixed tiles decide.
    """
    if not tune:
        return tiles.split_k > 1
    if device.type != "cuda":
        return True
    return -(-n // 64) < 2 * _multiprocessors(device.index if device.index is not None else 0)
