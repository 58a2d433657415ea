"""The validated settings of one `quantkit eval` run, built at the CLI edge and passed down."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError

TASKS = ("mmlu", "ppl")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EvalSettings:
    tasks: tuple[str, ...] = TASKS
    mmlu_dir: Path | None = None  # None: lm-eval's hub dataset (cais/mmlu)
    subjects: tuple[str, ...] = ()  # empty: every subject available
    num_fewshot: int = 5
    limit: int | None = None  # MMLU: questions per subject; ppl: the first windows (lm-eval's --limit)
    ppl_text: str = "wikitext2"  # a text file, or "wikitext2" from the hub
    seqlen: int = 2048
    batch_size: int = 8
    dtype: str = "float32"
    device: str = "cpu"
    cache_dir: Path | None = None  # None: no base-result cache
    # the quantized model's float lm_head held in int8 as the engine's --cpu-int8-lm-head holds it (CPU, bf16)
    cpu_int8_lm_head: bool = False

    def __post_init__(self):
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise QuantkitError(f"unknown task {', '.join(unknown) or '(none)'}; expected one or more of {', '.join(TASKS)}")
        if self.num_fewshot < 0:
            raise QuantkitError(f"--num-fewshot must be 0 or more (got {self.num_fewshot})")
        if self.limit is not None and self.limit < 1:
            raise QuantkitError(f"--limit must be at least 1 (got {self.limit})")
        if self.seqlen < 2:
            raise QuantkitError(f"--seqlen must be at least 2 (got {self.seqlen})")
        if self.batch_size < 1:
            raise QuantkitError(f"--batch-size must be at least 1 (got {self.batch_size})")
        if self.dtype not in DTYPE_NAMES:
            raise QuantkitError(f"unknown --dtype {self.dtype!r}; expected one of {', '.join(DTYPE_NAMES)}")
        if self.cpu_int8_lm_head and (self.device != "cpu" or self.dtype not in ("bfloat16", "float32")):
            raise QuantkitError("--cpu-int8-lm-head measures the engine's int8 lm_head on CPU: it needs --device cpu "
                                f"and --dtype bfloat16 or float32 (got {self.device}, {self.dtype})")
        if self.dtype == "float16" and self.device == "cpu":
            raise QuantkitError("--dtype float16 on CPU: fp16 matmul is unusably slow there; use float32 or bfloat16")

    def mmlu_key(self, subjects: list[str]) -> dict:
        """Everything that changes MMLU numbers (the cache key); the local files enter by content."""
        import lm_eval

        source = "hub:cais/mmlu" if self.mmlu_dir is None else f"local:{files_digest(self.mmlu_dir, subjects)}"
        return {"task": "mmlu", "lm_eval": lm_eval.__version__, "source": source, "subjects": subjects,
                "num_fewshot": self.num_fewshot, "limit": self.limit, "dtype": self.dtype, "device": self.device}

    def ppl_key(self, text: str) -> dict:
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        key = {"task": "ppl", "text": digest, "seqlen": self.seqlen, "dtype": self.dtype, "device": self.device}
        return key if self.limit is None else key | {"limit": self.limit}  # unlimited keys as before: caches stay valid


def files_digest(mmlu_dir: Path, subjects: list[str]) -> str:
    digest = hashlib.sha256()
    for subject in subjects:
        for split in ("test", "dev"):
            digest.update((mmlu_dir / split / f"{subject}_{split}.csv").read_bytes())
    return digest.hexdigest()[:16]
