"""Reading Hugging Face checkpoints: resolve a folder or hub id, read safetensors shards lazily.

`ShardReader` memory-maps the shards, hands out one tensor at a time and releases the pages it
read, so the quantize pipeline holds a single decoder layer in memory while the rest stays on disk.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.format.awq_plan import PLAN_FILE

NOT_WEIGHT_FILES = (PLAN_FILE,)
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken"]


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def check_model_reference(name: str) -> Path | None:
    """A local checkpoint folder (checked), or None for a name that may be fetched from the hub; QuantkitError
    for anything else. Reads no weights and downloads nothing: commands call it before starting work."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise QuantkitError(f"{name}: not a folder (expected a Hugging Face checkpoint folder)")
        if not (path / "config.json").is_file():
            raise QuantkitError(f"{name}: no config.json in this folder; is it a Hugging Face checkpoint?")
        return path
    _require_hub_id(name)
    return None


def resolve_model_path(name: str) -> Path:
    """A local checkpoint folder, or a hub id downloaded into the HF cache (safetensors only)."""
    path = check_model_reference(name)
    if path is not None:
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=WEIGHT_PATTERNS))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise QuantkitError(f"{name}: could not download from the Hugging Face hub ({type(exc).__name__})") from exc


def _require_hub_id(name: str) -> None:
    """`name` is not a local path: it must look like a hub id, and the hub must be online."""
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise QuantkitError(f"{name}: no such folder")
    if hub_offline():
        raise QuantkitError(f"{name}: not a local folder, and the Hugging Face hub is offline (HF_HUB_OFFLINE=1)")


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise QuantkitError(f"{path / 'config.json'}: unreadable ({exc})") from exc


# safetensors dtype names -> torch dtypes (the format's spec; unsigned wide ints need torch >= 2.3)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
PAGE = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lies in a shard: absolute byte range [start, end) in the file."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """Parse and validate a safetensors header; one line on a corrupt or truncated file.

    Layout: u64 little-endian header length N, N bytes of JSON, then the data buffer that the
    entries' `data_offsets` index (relative to the buffer's start).
    """
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(fh.read(header_len))
        entries = {k: _entry(file.name, 8 + header_len, v) for k, v in header.items() if k != "__metadata__"}
    except (struct.error, ValueError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise QuantkitError(f"{file}: corrupt safetensors file ({exc})") from exc
    end = max((e.end for e in entries.values()), default=0)
    if end > size:
        raise QuantkitError(f"{file}: truncated safetensors file ({size} bytes, header says {end})")
    return entries


def _entry(file: str, data_start: int, meta: dict) -> TensorEntry:
    dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
    if dtype is None:
        raise ValueError(f"unknown dtype {meta['dtype']}")
    shape = tuple(int(d) for d in meta["shape"])
    begin, stop = (int(o) for o in meta["data_offsets"])
    nbytes = math.prod(shape) * dtype.itemsize
    if stop - begin != nbytes or begin < 0:
        raise ValueError(f"data_offsets {begin}..{stop} do not hold {meta['dtype']}{list(shape)}")
    return TensorEntry(file, dtype, shape, data_start + begin, data_start + stop)


class ShardReader:
    """Lazy access to the tensors of a checkpoint folder (single file or sharded with an index).

    Shards are memory-mapped. `get` copies one tensor out of the mapping and then drops the
    mapped pages it touched (madvise DONTNEED): the page cache keeps them, but they stop counting
    against this process, so reading a model layer by layer holds one layer, not every page read
    so far. Shapes and dtypes come from the headers without touching the data.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise QuantkitError(f"{index}: unreadable index ({exc})") from exc
        else:
            # awq_plan.safetensors (AWQ's saved scales and clips) sits beside the weights but is not one
            files = sorted(p.name for p in self.path.glob("*.safetensors") if p.name not in NOT_WEIGHT_FILES)
            if not files:
                bins = list(self.path.glob("*.bin"))
                hint = " (only PyTorch .bin weights found; convert them to safetensors)" if bins else ""
                raise QuantkitError(f"{self.path}: no .safetensors weights{hint}")
        self.entries: dict[str, TensorEntry] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise QuantkitError(f"{file}: listed in the index but missing")
            for key, entry in read_safetensors_header(file).items():
                self.entries.setdefault(key, entry)
        self._maps: dict[str, mmap.mmap] = {}

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def _entry(self, key: str) -> TensorEntry:
        try:
            return self.entries[key]
        except KeyError as exc:
            raise QuantkitError(f"{self.path}: tensor {key} is missing from the checkpoint") from exc

    def shape_of(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def dtype_of(self, key: str) -> torch.dtype:
        return self._entry(key).dtype

    def get(self, key: str) -> torch.Tensor:
        """A tensor the caller owns (a copy), read through the mapping; its pages are then released."""
        e = self._entry(key)
        n = e.end - e.start
        if n == 0:
            return torch.empty(e.shape, dtype=e.dtype)
        mm = self._map(e.file)
        # the numpy copy is freshly allocated, hence aligned for any dtype view
        data = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=n, offset=e.start).copy())
        _release(mm, e.start, e.end)
        return data.view(e.dtype).reshape(e.shape)

    def entry(self, key: str) -> TensorEntry:
        """Where the tensor's bytes lie (in the file self.path / entry.file), for a copy that reads no data into
        memory (ShardWriter.add_stored)."""
        return self._entry(key)

    def rows(self, key: str, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [n] (int64, along dim 0) of a tensor, read from the file one row at a time (pread, not the
        mapping, whose page cache folios can map far more than the rows read): the input embeddings' rows of the
        calibration tokens, where `get` would copy the whole table (0.98 GB in bf16 at Llama 3's 128256 x 4096)."""
        e = self._entry(key)
        if not e.shape or e.end == e.start:
            raise QuantkitError(f"{self.path}: {key} has no rows to read ({e.dtype}{list(e.shape)})")
        if len(index) and not 0 <= int(index.min()) <= int(index.max()) < e.shape[0]:
            raise QuantkitError(f"{self.path}: rows of {key} asked past its {e.shape[0]} rows "
                                f"(a tokenizer for another vocabulary?)")
        row_bytes = (e.end - e.start) // e.shape[0]
        out = np.empty((len(index), row_bytes), dtype=np.uint8)
        try:
            fd = os.open(self.path / e.file, os.O_RDONLY)
        except OSError as exc:
            raise QuantkitError(f"{self.path / e.file}: cannot read ({exc})") from exc
        try:
            for i, row in enumerate(index.tolist()):
                if os.preadv(fd, [out[i]], e.start + row * row_bytes) != row_bytes:
                    raise QuantkitError(f"{self.path / e.file}: truncated at {key} row {row}")
        finally:
            os.close(fd)
        return torch.from_numpy(out).view(e.dtype).reshape(len(index), *e.shape[1:])

    def sample_bytes(self, key: str, size: int) -> bytes:
        """The first and the last `size` bytes of a tensor's data (all of it when it is shorter), read through the
        mapping without copying the tensor; its pages are then released."""
        e = self._entry(key)
        if e.end - e.start <= 2 * size:
            ranges = [(e.start, e.end)]
        else:
            ranges = [(e.start, e.start + size), (e.end - size, e.end)]
        mm = self._map(e.file) if e.end > e.start else None
        out = b"".join(mm[a:b] for a, b in ranges) if mm is not None else b""
        if mm is not None:
            _release(mm, e.start, e.end)
        return out

    def aligned(self, key: str) -> bool:
        """Whether the tensor's data starts at a multiple of its element size (then `mapped` can read it)."""
        e = self._entry(key)
        return e.start % e.dtype.itemsize == 0

    def mapped(self, key: str) -> torch.Tensor:
        """The tensor read in place from its file: a private copy-on-write mapping, so only the pages a
        reader touches (and the kernel's read-around) are mapped into this process (an embedding table's
        looked-up rows), and they stay evictable page cache. The mapping lives as long as the tensor; the
        file must not be rewritten meanwhile. (MADV_RANDOM, to map fewer pages, made each lookup of 8 rows
        6x slower here, 163 against 27 us, and a first pass over the table 35x slower.)"""
        e = self._entry(key)
        if not self.aligned(key):
            raise QuantkitError(f"{self.path / e.file}: {key} is not aligned for {e.dtype}; it cannot be mapped")
        try:
            with open(self.path / e.file, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise QuantkitError(f"{self.path / e.file}: cannot map ({exc})") from exc
        n = math.prod(e.shape)
        return torch.frombuffer(mm, dtype=e.dtype, count=n, offset=e.start).reshape(e.shape)

    def _map(self, file: str) -> mmap.mmap:
        mm = self._maps.get(file)
        if mm is None:
            try:
                with open(self.path / file, "rb") as fh:
                    mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:
                raise QuantkitError(f"{self.path / file}: cannot map ({exc})") from exc
            self._maps[file] = mm
        return mm

    def num_elements(self) -> int:
        """Elements of every tensor, from the headers (no data read)."""
        return sum(math.prod(e.shape) for e in self.entries.values())

    def total_bytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in {e.file for e in self.entries.values()})

    def close(self) -> None:
        for mm in self._maps.values():
            mm.close()
        self._maps.clear()


def _release(mm: mmap.mmap, start: int, end: int) -> None:
    """Drop this process's mapped pages of [start, end) (they stay in the page cache)."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    first = start // PAGE * PAGE
    mm.madvise(mmap.MADV_DONTNEED, first, end - first)


def resolve_config(name: str) -> dict:
    """config.json of a local folder, or of a hub id (config.json alone is downloaded)."""
    path = Path(name).expanduser()
    if path.exists() or path.name == "config.json":
        folder = path.parent if path.name == "config.json" else resolve_model_path(name)
        return read_config(folder)
    _require_hub_id(name)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return read_config(Path(hf_hub_download(name, "config.json")).parent)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise QuantkitError(f"{name}: could not download config.json from the Hugging Face hub "
                            f"({type(exc).__name__})") from exc
