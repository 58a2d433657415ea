"""llama.cpp's batched decoding (llamacpp_worker.py batched, through llama_batch with one sequence id per prompt)
against its own batch-1 greedy decoding (the worker's `serve` mode, llama-cpp-python's Llama.eval), on the tiny
Llama written to F32 GGUF. Interop: needs llama-cpp-python's venv (QUANTKIT_LLAMACPP_VENV, or ../.venvs/llamacpp):
    QUANTKIT_LLAMACPP_VENV=VENV .venv/bin/pytest -q -m interop tests/bench/test_llamacpp_process.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("QUANTKIT_LLAMACPP_VENV", REPO.parent / ".venvs" / "llamacpp"))


@pytest.fixture
def llamacpp_python() -> Path:
    if not (VENV / "bin" / "python").exists():
        pytest.skip(f"no llama-cpp-python venv at {VENV} (set QUANTKIT_LLAMACPP_VENV): python3 -m venv VENV && "
                    "VENV/bin/pip install llama-cpp-python==0.3.36 gguf")
    return VENV / "bin" / "python"


def decided_steps(model: Path, prompt: list[int], tokens: list[int], margin: float = 0.01) -> int:
    """How many of `tokens` (a greedy continuation of `prompt`) come before the first step whose top-2 logits
    transformers puts within `margin`: past a near-tie, a batched matmul's rounding may pick the other token."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:]  # [len(tokens) + 1, vocab]
    top = logits.topk(2, dim=-1).values
    close = ((top[:, 0] - top[:, 1]) < margin).nonzero()
    return min(len(tokens), int(close[0, 0]) if len(close) else len(tokens))


@pytest.mark.interop
@pytest.mark.slow
def test_two_sequences_decoded_together_give_each_prompts_batch1_greedy_tokens(tiny_llama, tmp_path, llamacpp_python):
    pytest.importorskip("gguf", reason="the gguf package writes the GGUF")
    from quantkit.bench.gguf_export import write_gguf
    from quantkit.bench.llamacpp_process import LlamaCppBatched
    from quantkit.bench.vs_llamacpp import LlamaCpp

    gguf = write_gguf(tiny_llama, tmp_path / "m.gguf", "f32")
    prompts = [[5, 9, 14, 23, 40, 77, 120], [300, 8, 91, 2, 64, 17, 250, 11, 3, 180, 44]]  # unequal lengths
    n = 24
    single = LlamaCpp(llamacpp_python, {"F32": gguf}, threads=2, log=tmp_path / "serve.log")
    try:
        want = [single.run("F32", p, n).tokens for p in prompts]
    finally:
        single.close()
    batched = LlamaCppBatched(llamacpp_python, gguf, threads=2, n_ctx=64, max_seqs=2, log=tmp_path / "batched.log")
    try:
        together = batched.run(prompts, n)
        alone = batched.run(prompts[1:], n)  # the cache is cleared between jobs: sequence 0 starts afresh
    finally:
        batched.close()
    assert want[0] != want[1]  # distinct continuations: a mixed-up sequence id would show
    sure = [decided_steps(tiny_llama, p, w) for p, w in zip(prompts, want)]
    assert min(sure) >= 6, sure
    assert [t[:k] for t, k in zip(together.tokens, sure)] == [w[:k] for w, k in zip(want, sure)]
    assert alone.tokens[0][:sure[1]] == want[1][:sure[1]]
    assert together.decode_tok_s == pytest.approx(2 * (n - 1) / together.decode_s)
    assert together.prefill_s > 0 and together.decode_s > 0
