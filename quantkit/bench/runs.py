"""What the quantize benchmarks share: a random Llama of a given shape, and one `quantkit quantize`
run in a child process that reports its own peak RSS (quantkit.bench.peak_rss)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# TinyLlama-1.1B's layer shapes
ONE_B = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
             vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)


@dataclass
class QuantizeRun:
    quantize_s: float | None  # the pipeline's own wall_seconds (imports and start-up excluded); None for --dry-run
    process_s: float
    peak_rss_gib: float


def make_random_llama(out: Path, layers: int, shape: dict = ONE_B) -> Path:
    """A randomly initialised Llama of `shape` with `layers` decoder layers, saved in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.calibration.synthetic import build_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer(vocab_size=512).save_pretrained(out)
    return out


def quantize_in_child(model: Path, out: Path, args: list[str], threads: int = 1) -> QuantizeRun:
    """Run `quantkit quantize MODEL --out OUT --force ARGS` in a child process and measure it."""
    peak_file = out.with_name(out.name + ".peak_rss")
    cmd = [sys.executable, "-m", "quantkit.bench.peak_rss", str(peak_file),
           "quantize", str(model), "--out", str(out), "--force", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr.decode()[-2000:]}")
    meta = out / "quantkit_meta.json"
    quantize_s = json.loads(meta.read_text())["wall_seconds"] if meta.is_file() else None
    peak = int(peak_file.read_text())
    peak_file.unlink()
    return QuantizeRun(quantize_s, time.perf_counter() - start, peak / 1024**3)
