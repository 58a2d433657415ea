"""Streaming tensors into safetensors shards, each byte written once.

A shard is written under a temporary name (part-0000i.safetensors.tmp): its first `header_reserve` bytes are left
for the u64 header length and the JSON header, and each tensor's bytes go straight after them as they come, so the
writer holds one tensor at a time, not a shard. When the shard closes its header is written into the reserved region,
padded with trailing spaces (which safetensors allows) to fill it. Only when the header does not fit, or would leave
more than 1/MAX_PADDING_SHARE of the data in spaces (a small shard: a tiny model's), are the data moved within the
file to sit right after the header (then the bytes are those of a shard written header first). `finish` renames the
shards to their final names; a shard that fails half-written is removed, and `abort` removes every shard not yet
renamed, so a half-written file never appears under a final name nor stays behind under its temporary one.

Tensors already in a safetensors file of the right dtype (the embeddings and lm_head a quantizer copies as they are)
are copied file to file (`add_stored`, os.copy_file_range), never read into memory nor converted.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import torch

from quantkit.model.checkpoint import SAFETENSORS_DTYPES, TensorEntry

SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
PAGE_BYTES = 4096
HEADER_RESERVE_MIN = PAGE_BYTES
HEADER_RESERVE_MAX = 8 << 20  # safetensors refuses headers past 100 MB
MAX_PADDING_SHARE = 64  # a kept reserve may hold at most 1/64 of its shard's data size in spaces
MOVE_CHUNK = 8 << 20  # bytes per read / write when the data are moved within a shard
COPY_CHUNK = 1 << 30  # bytes per os.copy_file_range call
KERNEL_COPY_UNSUPPORTED = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def header_reserve(max_shard_bytes: int) -> int:
    """Bytes reserved at a shard's start for its length prefix and header: 1/1024 of the shard limit in whole pages,
    4 KiB to 8 MiB (2 MiB at the default 2 GiB shards: about 19,000 header entries of a packed linear's ~110 bytes,
    where an MoE layer of 128 experts has about 1,600)."""
    pages = -(-(max_shard_bytes >> 10) // PAGE_BYTES)
    return min(max(pages * PAGE_BYTES, HEADER_RESERVE_MIN), HEADER_RESERVE_MAX)


def header_bytes(entries: dict[str, dict]) -> bytes:
    """The JSON header of a shard, padded with spaces to a multiple of 8 bytes (the data's alignment)."""
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8)


def data_start(header: bytes, reserve: int, nbytes: int) -> int:
    """Where a shard's data will start, given its padded header: the reserve's end when the header fits in it and
    the spaces left are at most 1/MAX_PADDING_SHARE of the data; else right after the header."""
    tight = 8 + len(header)
    if tight <= reserve and (reserve - tight) * MAX_PADDING_SHARE <= nbytes:
        return reserve
    return tight


class ShardWriter:
    """Streams tensors into safetensors shards (see the module docstring); use as a context manager, or call
    `abort` on failure, so that no temporary file stays behind."""

    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.reserve = header_reserve(max_shard_bytes)
        self._parts: list[tuple[Path, list[str]]] = []
        self._open: _OpenShard | None = None
        self.total_bytes = 0

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        # widest dtypes first, as safetensors orders them, so that offsets stay aligned
        for name, t in sorted(tensors.items(), key=lambda kv: -kv[1].element_size()):
            self._shard_for(t.numel() * t.element_size()).write(name, t)

    def add_stored(self, name: str, entry: TensorEntry, folder: Path) -> None:
        """One tensor copied as it is from the safetensors file folder / entry.file (bytes, dtype, shape unchanged)."""
        self._shard_for(entry.nbytes).copy(name, entry, Path(folder) / entry.file)

    def _shard_for(self, size: int) -> _OpenShard:
        """The shard that takes the next `size` bytes (a new one when they would pass the limit)."""
        if self._open is not None and self._open.nbytes and self._open.nbytes + size > self.max_shard_bytes:
            self._close()
        if self._open is None:
            self._open = _OpenShard(self.out_dir / f"part-{len(self._parts):05d}.safetensors.tmp", self.reserve)
        self.total_bytes += size
        return self._open

    def _close(self) -> None:
        shard, self._open = self._open, None
        self._parts.append((shard.path, shard.finish()))

    def finish(self) -> list[str]:
        """Name the shards model.safetensors or model-0000i-of-0000N.safetensors, and always write
        the index: loaders that glob *.safetensors (vLLM) then read only the files it names, not
        other safetensors files kept beside the weights (awq_plan.safetensors)."""
        if self._open is None and not self._parts:  # nothing was added: still one (empty) shard
            self._shard_for(0)
        if self._open is not None:
            self._close()
        n = len(self._parts)
        weight_map, names = {}, []
        for i, (part, keys) in enumerate(self._parts, 1):
            name = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            part.rename(self.out_dir / name)
            names.append(name)
            weight_map.update({k: name for k in keys})
        self._parts.clear()
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return names

    def abort(self) -> None:
        """Remove every shard not yet renamed (the open one and the closed ones)."""
        if self._open is not None:
            self._open.discard()
            self._open = None
        for part, _ in self._parts:
            part.unlink(missing_ok=True)
        self._parts.clear()


class _OpenShard:
    """One shard being written: its file (data from `reserve` on) and the header entries of what is in it."""

    def __init__(self, path: Path, reserve: int):
        self.path = path
        self.reserve = reserve
        self._fh = open(path, "w+b", buffering=0)  # unbuffered: tensor writes and file copies share the offset; read
        # back only if the data must move
        self._fh.seek(reserve)
        self.header: dict[str, dict] = {}
        self.nbytes = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        if t.numel():
            _write_all(self._fh, memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._entry(name, t.dtype, list(t.shape), t.numel() * t.element_size())

    def copy(self, name: str, entry: TensorEntry, path: Path) -> None:
        with open(path, "rb") as src:
            _copy_range(src.fileno(), self._fh.fileno(), entry.start, entry.nbytes)
        self._entry(name, entry.dtype, list(entry.shape), entry.nbytes)

    def _entry(self, name: str, dtype: torch.dtype, shape: list[int], size: int) -> None:
        end = self.nbytes + size
        self.header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": shape, "data_offsets": [self.nbytes, end]}
        self.nbytes = end

    def finish(self) -> list[str]:
        """Write the header (u64 length, JSON padded with spaces) before the data, moving the data only when
        `data_start` says so; the file is removed if this fails. Returns the shard's tensor names."""
        try:
            header = header_bytes(self.header)
            start = data_start(header, self.reserve, self.nbytes)
            fd = self._fh.fileno()
            if start != self.reserve:
                _move(fd, self.reserve, start, self.nbytes)
                os.ftruncate(fd, start + self.nbytes)
            header += b" " * (start - 8 - len(header))
            os.pwrite(fd, struct.pack("<Q", len(header)) + header, 0)
            self._fh.close()
        except BaseException:
            self.discard()
            raise
        return list(self.header)

    def discard(self) -> None:
        self._fh.close()
        self.path.unlink(missing_ok=True)


def _write_all(fh, data: memoryview) -> None:
    """All of `data` through an unbuffered file (whose write may take fewer bytes than given)."""
    while data:
        data = data[fh.write(data):]


def _copy_range(src: int, dst: int, offset: int, nbytes: int) -> None:
    """src's bytes [offset, offset + nbytes) appended at dst's file offset."""
    done = 0
    while done < nbytes:
        n = _copy_chunk(src, dst, offset + done, nbytes - done)
        if n == 0:
            raise OSError(f"the source file ends {nbytes - done} bytes early")
        done += n


def _copy_chunk(src: int, dst: int, offset: int, count: int) -> int:
    """Up to `count` bytes copied in the kernel (os.copy_file_range), or through a buffer where the kernel cannot
    (another platform or file system); returns how many."""
    kernel_copy = getattr(os, "copy_file_range", None)
    if kernel_copy is not None:
        try:
            return kernel_copy(src, dst, min(COPY_CHUNK, count), offset)
        except OSError as exc:
            if exc.errno not in KERNEL_COPY_UNSUPPORTED:
                raise
    return os.write(dst, os.pread(src, min(MOVE_CHUNK, count), offset))


def _move(fd: int, src: int, dst: int, nbytes: int) -> None:
    """Bytes [src, src + nbytes) of a file moved to start at dst (the ranges may overlap: a move toward the start
    copies front to back, a move toward the end back to front)."""
    chunks = [(i, min(MOVE_CHUNK, nbytes - i)) for i in range(0, nbytes, MOVE_CHUNK)]
    for i, n in chunks if dst < src else reversed(chunks):
        os.pwrite(fd, os.pread(fd, n, src + i), dst + i)
