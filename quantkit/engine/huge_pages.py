"""The engine's weights in transparent huge pages (CPU, Linux).

A batch-1 decode step reads every weight once, and on 4 KiB pages it pays a TLB miss (a page walk) every 4 KiB while
the hardware's stream prefetcher stops at each page boundary. In 2 MiB pages both go: on the EPYC BF16 machine a
streaming read of 2 GiB ran 1.15-1.5x faster, and the Llama-3.2-1B shape's 4-bit decode 1.14x (two engines on one
checkpoint in one process, eight alternating rounds, every round 1.06x or more; docs/BENCHMARKS.md).

Linux backs anonymous memory with huge pages where the mapping was advised MADV_HUGEPAGE before it was touched (THP
mode "madvise", most distributions' default) or everywhere ("always"); never under "never". torch's allocator
advises only when THP_MEM_ALLOC_ENABLE=1 was set before its first allocation, which a library loaded into someone
else's process cannot promise. So `move_to_huge_pages` copies the model's large weight storages, once loaded and
repacked, into one anonymous mapping advised MADV_HUGEPAGE (an arena: storages end to end at 64-byte offsets, so
the rounding up to a whole huge page is paid once, not per tensor), and points every tensor that shares a storage
(views included: an MoE's stacked experts) at its copy, whose old storage is then freed. Values are unchanged, bit
for bit; the file-mapped embedding table (MappedEmbedding) is left where it is: decode reads one row of it.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.memory import release_freed_memory

log = logging.getLogger("quantkit.engine")

HUGE_PAGE = 2 * 1024**2
MIN_BYTES = HUGE_PAGE  # smaller storages share pages with the rest anyway
ALIGN = 64  # each storage's offset in the arena: a cache line, as the kernels' loads expect at most
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class HugePages:
    """What move_to_huge_pages did: bytes and storages moved into the arena, or why nothing was."""

    moved_bytes: int = 0
    storages: int = 0
    skipped: str | None = None  # the reason where nothing was moved

    def describe(self) -> str:
        if self.skipped:
            return f"weights in 4 KiB pages ({self.skipped})"
        return f"weights in transparent huge pages: {self.moved_bytes / 1024**2:.1f} MiB, {self.storages} storages"


def thp_unavailable(mode_file: Path | None = None) -> str | None:
    """None where an advised mapping gets huge pages, else why not (the mode "never", or no THP at all)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this platform has no MADV_HUGEPAGE"
    mode_file = mode_file or THP_MODE_FILE
    try:
        text = mode_file.read_text()
    except OSError:
        return f"no transparent huge pages here ({mode_file} unreadable)"
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()
    return "transparent huge pages are off (mode never)" if chosen == "never" else None


def arena_offsets(sizes: list[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Each storage's offset in the arena (storages end to end, each at a multiple of `align`) and the arena's
    length, rounded up to whole huge pages."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // align) * align
    return offsets, -(-end // HUGE_PAGE) * HUGE_PAGE


def _advised_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous mapping of whole huge pages holding `nbytes`, advised MADV_HUGEPAGE before any page is touched
    (the faults then take whole huge pages)."""
    arena = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    return arena


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] in an anonymous mapping advised MADV_HUGEPAGE, zero-filled (every page touched), for a
    bandwidth loop to read as decode reads moved weights. Raises RuntimeError where THP is unavailable."""
    if (why := thp_unavailable()) is not None:
        raise RuntimeError(why)
    buf = torch.frombuffer(_advised_mapping(nbytes), dtype=torch.uint8, count=nbytes)  # holds the mapping alive
    return buf.fill_(0)


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
    """`count` zero tensors of `shape` and `dtype`, end to end in one anonymous mapping advised MADV_HUGEPAGE (the KV
    cache: a decode step reads its blocks wherever the pool put them, a TLB miss a block in 4 KiB pages). Raises
    RuntimeError where THP is unavailable."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    offsets, total = arena_offsets([nbytes] * count)
    arena = huge_page_buffer(total)
    return [arena[o:o + nbytes].view(dtype).view(shape) for o in offsets]


def weight_tensors(model: torch.nn.Module, skip: tuple[type, ...] = ()) -> list[torch.Tensor]:
    """Every CPU tensor the model's modules hold, once each: parameters, buffers and attributes, including those
    inside dataclass values (a repacked weight, a prebound kernel call) and lists, tuples and dicts of them;
    with `skip`, only the modules of those types (`kept` below: what move_to_huge_pages leaves)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(value, depth: int) -> None:
        if depth > 4 or id(value) in seen or isinstance(value, torch.nn.Module):
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and value.layout == torch.strided:  # not oneDNN's opaque prepacked ones
                found.setdefault(id(value), value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name), depth + 1)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v, depth + 1)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v, depth + 1)

    for module in model.modules():
        if skip and not isinstance(module, skip):
            continue
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            visit(value, 0)
    return list(found.values())


def move_to_huge_pages(model: torch.nn.Module, skip: tuple[type, ...] = (), min_bytes: int = MIN_BYTES) -> HugePages:
    """The model's storages of `min_bytes` or more copied into one MADV_HUGEPAGE mapping, every tensor on them
    re-pointed (module docstring), but those of modules of a `skip` type (shared with others too: a tied head).
    Nothing is moved where THP is unavailable (HugePages.skipped says why)."""
    if (why := thp_unavailable()) is not None:
        return HugePages(skipped=why)
    kept = {t.untyped_storage().data_ptr() for t in weight_tensors(model, skip)} if skip else set()
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in weight_tensors(model):
        if t.untyped_storage().nbytes() >= min_bytes and t.untyped_storage().data_ptr() not in kept:
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    if not by_storage:
        return HugePages(skipped=f"no weight storage of {min_bytes / 1024**2:g} MiB or more")
    groups = list(by_storage.values())
    sizes = [g[0].untyped_storage().nbytes() for g in groups]
    offsets, length = arena_offsets(sizes)
    arena = _advised_mapping(length)
    with torch.no_grad():
        for tensors, offset, n in zip(groups, offsets, sizes):
            old = tensors[0].untyped_storage()
            copy = torch.frombuffer(arena, dtype=torch.uint8, count=n, offset=offset)  # holds the arena alive
            copy.copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for t in tensors:
                t.set_(copy.untyped_storage(), t.storage_offset(), t.size(), t.stride())
            del old
    release_freed_memory()  # the old storages' heap pages back to the system, not kept by malloc beside the arena
    return HugePages(sum(sizes), len(groups))
