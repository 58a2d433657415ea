"""The accuracy suite: small Llamas of different shapes, trained in fp32 on WikiText-2 valid, plus stories260K-hf.

  python -m quantkit.bench.suite [--models NAME,...|ci|all] [--threads 2] [--force]

The suite is this module's SUITE table. Its trained models span what quantizers meet in users' checkpoints
in miniature: multi-head and grouped-query attention at 2:1, 4:1 and 8:1, tied and untied embeddings,
depths 4 to 12, widths 64 to 512, and two tokenizers (a byte-level BPE trained on the text, at 512 and
1024 tokens, and stories260K-hf's sentencepiece tokenizer). They train in fp32 (never bf16 autocast),
so their weights do not depend on the CPU's bf16 arithmetic.

Each is trained by quantkit.bench.train_tiny and cached under ~/.cache/quantkit/suite/NAME (or
$QUANTKIT_SUITE_DIR/NAME): written to a temporary folder and renamed, and reused unless its settings
differ or --force. `ci` models train in under 75 CPU seconds each (272 s for all five on one
thread, 2026-12-05, AMD EPYC), so the tests
(tests/quant/test_suite_floors.py) train them on a clean machine; the 512-wide one takes minutes and is
trained only by this command (their tests skip, saying so, while the cache lacks them).
configs/accuracy_floors.toml holds each model's floors, in the table `suite_NAME`.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.bench.train_tiny import SHARED, TinySpec, cached_model, train


@dataclass(frozen=True)
class SuiteModel:
    name: str
    group: int  # the quantization group size its floors and the benchmark use
    spec: TinySpec | None = None  # None: the fixed checkpoint `checkpoint` under ../shared/data
    ci: bool = True  # the tests train it when it is not cached
    checkpoint: str | None = None
    targets: str = "all"  # llm-compressor's targets (tests/interop/llmcompressor_gptq.py)

    @property
    def attention(self) -> str:
        spec = self.spec
        if spec is None:
            return "fixed checkpoint"
        return "MHA" if spec.heads == spec.kv_heads else f"GQA {spec.heads // spec.kv_heads}:1"


def _spec(hidden, layers, heads, kv_heads, intermediate, tie, tokenizer, vocab, steps) -> TinySpec:
    # 8 windows of 128 tokens a step keep a step cheap; the step count sets each model's training time
    return TinySpec(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                    vocab=vocab, steps=steps, batch=8, seqlen=128, tie=tie, tokenizer=tokenizer)


SUITE: tuple[SuiteModel, ...] = (
    SuiteModel("mha-w64-d4", 64, _spec(64, 4, 4, 4, 192, True, "bpe", 512, 800)),
    SuiteModel("gqa2-w128-d8", 64, _spec(128, 8, 4, 2, 384, False, "bpe", 1024, 250)),
    SuiteModel("gqa4-w256-d6", 128, _spec(256, 6, 8, 2, 512, True, "stories", 512, 120)),
    SuiteModel("gqa8-w128-d12", 64, _spec(128, 12, 8, 1, 256, False, "bpe", 1024, 250)),
    SuiteModel("mha-w128-d4", 64, _spec(128, 4, 4, 4, 384, False, "stories", 512, 400)),
    SuiteModel("gqa8-w512-d4", 128, _spec(512, 4, 16, 2, 1024, False, "bpe", 1024, 150), ci=False),
    # stories260K's MLP (intermediate 172) does not split into groups of 64: only attention packs
    SuiteModel("stories260k", 64, checkpoint="stories260K-hf", targets="attention"),
)
BY_NAME = {m.name: m for m in SUITE}


def suite_dir() -> Path:
    env = os.environ.get("QUANTKIT_SUITE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "quantkit" / "suite"


def lookup(name: str) -> SuiteModel:
    if name not in BY_NAME:
        raise SystemExit(f"unknown suite model {name!r}: one of {', '.join(BY_NAME)}")
    return BY_NAME[name]


def cached_path(model: SuiteModel) -> Path | None:
    """The model's folder when it is ready to use (a shipped checkpoint, or trained with exactly its spec)."""
    if model.spec is None:
        path = SHARED / model.checkpoint
        return path if path.is_dir() else None
    return cached_model(suite_dir() / model.name, model.spec)


def ensure(model: SuiteModel, force: bool = False, show_progress: bool = True) -> Path:
    """The model's folder, training it first when it is not cached (or `force`)."""
    path = None if force else cached_path(model)
    if path is not None:
        return path
    if model.spec is None:
        raise SystemExit(f"{model.name}: {SHARED / model.checkpoint} not found (see ../shared/data/SOURCES.md)")
    out = suite_dir() / model.name
    out.parent.mkdir(parents=True, exist_ok=True)
    train(out, model.spec, show_progress)
    return out


def select(names: str) -> list[SuiteModel]:
    """`all`, `ci` (the models the tests train), or comma-separated names."""
    if names == "all":
        return list(SUITE)
    if names == "ci":
        return [m for m in SUITE if m.ci]
    return [lookup(n.strip()) for n in names.split(",")]


def describe(model: SuiteModel, path: Path) -> str:
    """A table line: shape, training settings and what train_meta.json recorded."""
    spec = model.spec
    if spec is None:
        return f"| {model.name} | {model.attention} | - | - | - | - | g{model.group} | - | - | - | - |"
    meta = json.loads((path / "train_meta.json").read_text())
    return (f"| {model.name} | {model.attention} | {spec.hidden} x {spec.layers} | {'tied' if spec.tie else 'untied'} "
            f"| {spec.tokenizer} {spec.vocab} | {spec.steps} | g{model.group} | {meta['seconds']} "
            f"(load {meta['load_avg']}) | {meta.get('cpu_seconds', '-')} | {meta['last20_mean_loss']} | {meta['test_ppl_20k_256']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="all", help="all, ci, or comma-separated names of SUITE")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="train even when a model with these settings is cached")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = select(args.models)
    paths = [ensure(m, args.force) for m in models]
    print("| model | attention | hidden x layers | embeddings | tokenizer | steps | group | train s | train CPU s | loss (last 20) "
          "| test ppl |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m, path in zip(models, paths):
        print(describe(m, path))


if __name__ == "__main__":
    main()
