"""Calibration data: documents from a local file, folder or named hub corpus, tokenized once
and cut into `nsamples` windows of `seqlen` tokens, deterministically for a seed."""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.calibration.corpora import CORPORA, Corpus
from quantkit.calibration.token_cache import cached_token_ids
from quantkit.errors import QuantkitError

LOCAL_SUFFIXES = (".txt", ".jsonl")


@dataclass
class CalibSet:
    input_ids: torch.Tensor  # [nsamples, seqlen] int64
    source: str
    notes: list[str] = field(default_factory=list)
    text_tokens: int = 0  # tokens of the whole text the windows were cut from (they repeat past it)

    @property
    def token_hash(self) -> str:
        """sha256 of the token ids, for the audit trail in quantkit_meta.json."""
        return hashlib.sha256(self.input_ids.to(torch.int64).numpy().tobytes()).hexdigest()


def split_text_documents(text: str) -> list[str]:
    """A .txt file's documents are separated by blank lines."""
    docs, current = [], []
    for line in text.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            docs.append("\n".join(current))
            current = []
    if current:
        docs.append("\n".join(current))
    return docs


def read_jsonl_documents(path: Path) -> list[str]:
    docs = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QuantkitError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise QuantkitError(f"{path}:{lineno}: expected an object with a \"text\" string field")
        docs.append(row["text"])
    return docs


def read_local_documents(path: Path) -> list[str]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file())
        if not files:
            raise QuantkitError(f"{path}: no .txt or .jsonl files in this folder")
        return [d for f in files for d in read_local_documents(f)]
    if path.suffix == ".jsonl":
        return read_jsonl_documents(path)
    if path.suffix == ".txt":
        try:
            return split_text_documents(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise QuantkitError(f"{path}: not UTF-8 text") from exc
    raise QuantkitError(f"{path}: calibration files must be .txt (documents split on blank lines) or .jsonl")


def datasets_offline() -> bool:
    flags = (os.environ.get("HF_DATASETS_OFFLINE", ""), os.environ.get("HF_HUB_OFFLINE", ""))
    return any(f.lower() in ("1", "true", "yes", "on") for f in flags)


def read_corpus_documents(corpus: Corpus, max_docs: int, seed: int) -> list[str]:
    if datasets_offline():
        raise QuantkitError(
            f"calibration corpus {corpus.name!r} loads the hub dataset {corpus.dataset}, but the hub is offline; "
            f"pass a local file with --calib FILE.txt|FILE.jsonl|FOLDER"
        )
    try:
        import datasets
    except ImportError as exc:
        raise QuantkitError("hub calibration corpora need the datasets package: pip install 'quantkit[eval]'") from exc
    try:
        ds = datasets.load_dataset(corpus.dataset, corpus.config, split=corpus.split, data_files=corpus.data_files)
    except (OSError, ValueError, ConnectionError) as exc:
        raise QuantkitError(f"could not load {corpus.dataset} for calibration ({type(exc).__name__}: {exc})") from exc
    order = list(range(len(ds)))
    if corpus.shuffle_documents:
        random.Random(seed).shuffle(order)
    texts = (ds[i][corpus.text_field] for i in order)
    return [t for t, _ in zip((t for t in texts if t.strip()), range(max_docs))]


def sample_windows(ids: torch.Tensor, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """`nsamples` windows of `seqlen` tokens at seeded random offsets of a 1-D token stream."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seqlen + 1, (nsamples,), generator=gen)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])


def _tokenize(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.int64)


def load_calibration(source: str, tokenizer, nsamples: int, seqlen: int, seed: int) -> CalibSet:
    """Tokenize the documents once (joined by blank lines; the ids are cached on disk, see
    token_cache.py) and cut seeded windows."""
    notes: list[str] = []
    path = Path(source).expanduser()
    if path.exists():
        docs = read_local_documents(path)
    elif source in CORPORA:
        docs = read_corpus_documents(CORPORA[source], max_docs=max(4 * nsamples, 1000), seed=seed)
    elif path.suffix in LOCAL_SUFFIXES or "/" in source:
        raise QuantkitError(f"{source}: no such calibration file or folder")
    else:
        raise QuantkitError(f"unknown calibration source {source!r}: pass a .txt/.jsonl file, a folder, "
                            f"or one of the corpora {', '.join(CORPORA)}")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise QuantkitError(f"{source}: the calibration set is empty")
    ids, _ = cached_token_ids("\n\n".join(docs), tokenizer, lambda text: _tokenize(tokenizer, text))
    if ids.numel() == 0:
        raise QuantkitError(f"{source}: the calibration set is empty after tokenization")
    if ids.numel() < seqlen:
        notes.append(f"calibration text has only {ids.numel()} tokens: seqlen lowered from {seqlen} to {ids.numel()}")
        seqlen = int(ids.numel())
    return CalibSet(sample_windows(ids, nsamples, seqlen, seed), source=source, notes=notes,
                    text_tokens=int(ids.numel()))
