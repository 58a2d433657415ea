"""The base-result cache: results keyed by checkpoint content hash and task settings.

Comparing five quantized variants against one base evaluates the base once. The key is
sha256(checkpoint files) + sha256(task settings); the checkpoint hash itself is memoised
per (path, size, mtime) so a 14 GB base is read once, not on every run.
Layout: <cache_dir>/results/<checkpoint hash>/<settings hash>.json, <cache_dir>/hashes.json.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

HASHED_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".tiktoken")
CHUNK = 1 << 22


def default_cache_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit")) / "eval"


def checkpoint_files(path: Path) -> list[Path]:
    """Everything that decides a model's outputs: config, weights, tokenizer files."""
    return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(HASHED_SUFFIXES))


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


class ResultCache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _memo_path(self) -> Path:
        return self.root / "hashes.json"

    def checkpoint_hash(self, path: Path) -> str:
        files = checkpoint_files(Path(path))
        stamp = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        memo_key = hashlib.sha256(json.dumps([str(Path(path).resolve()), stamp]).encode()).hexdigest()
        memo = self._read_json(self._memo_path()) or {}
        if memo_key in memo:
            return memo[memo_key]
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                while chunk := fh.read(CHUNK):
                    digest.update(chunk)
        value = digest.hexdigest()[:16]
        memo[memo_key] = value
        self._write_json(self._memo_path(), memo)
        return value

    def _entry(self, ckpt_hash: str, settings: dict) -> Path:
        return self.root / "results" / ckpt_hash / f"{settings_hash(settings)}.json"

    def get(self, ckpt_hash: str, settings: dict) -> dict | None:
        entry = self._read_json(self._entry(ckpt_hash, settings))
        if entry is None or entry.get("settings") != settings:  # a hash collision or a stale format
            return None
        return entry["result"]

    def put(self, ckpt_hash: str, settings: dict, result: dict) -> None:
        self._write_json(self._entry(ckpt_hash, settings), {"settings": settings, "result": result})

    @staticmethod
    def _read_json(path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    @staticmethod
    def _write_json(path: Path, data: dict) -> None:
        """Write beside, then rename: a killed run never leaves half a cache entry."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
