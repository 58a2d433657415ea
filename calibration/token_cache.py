"""A disk cache of calibration token ids, so a calibration file is tokenized once per tokenizer.

Tokenizing all of a calibration text to cut a few seeded windows from it costs more than the
windows' use on a small model (about 1 s for WikiText-2 valid, 0.4 M tokens). The windows depend
on the whole token stream (offsets are drawn over its length), so the stream is cached whole and
the windows stay the ones llm-compressor's side of the benchmark cuts from the same text.

Key: sha256 of the text, of the tokenizer's serialized form (fast tokenizers only; others are not
cached) and of the call's settings. Layout: <cache>/calib-tokens/<key>.pt, int64 [T]; written to a
temporary name and renamed, so a reader never sees half a file. $QUANTKIT_CACHE moves the cache.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

SETTINGS = b"add_special_tokens=False;v1"


def default_cache_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit")) / "calib-tokens"


def tokenizer_fingerprint(tokenizer) -> str | None:
    """sha256 of a fast tokenizer's full serialized state (vocab, merges, normalizer, ...); None
    for tokenizers without one, which are then not cached."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return hashlib.sha256(backend.to_str().encode()).hexdigest()


def cache_key(text: str, fingerprint: str) -> str:
    h = hashlib.sha256(SETTINGS)
    h.update(fingerprint.encode())
    h.update(text.encode("utf-8"))
    return h.hexdigest()[:32]


def cached_token_ids(text: str, tokenizer, tokenize: Callable[[str], torch.Tensor],
                     cache_dir: Path | None = None) -> tuple[torch.Tensor, bool]:
    """`tokenize(text)` [T] int64, from the cache when it holds this text and tokenizer.
    Returns (ids, whether they came from the cache)."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        return tokenize(text), False
    root = cache_dir or default_cache_dir()
    path = root / f"{cache_key(text, fingerprint)}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True), True
    ids = tokenize(text)
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    torch.save(ids, tmp)
    tmp.replace(path)
    return ids, False
