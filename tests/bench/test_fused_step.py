"""The fused-step benchmark at toy size: both settings run and are timed, and the unfused setting is undone."""

import subprocess
import sys


def test_fused_step_bench_runs_at_toy_size(tiny_llama):
    out = subprocess.run([sys.executable, "-m", "quantkit.bench.fused_step", str(tiny_llama), "--batches", "1,2",
                          "--rounds", "1", "--max-tokens", "4", "--prompt-len", "8", "--threads", "1",
                          "--dtype", "float32", "--max-model-len", "128"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if " batch " in line]
    assert len(rows) == 2 and all("fused / unfused" in r for r in rows)


def test_unfused_restores_the_engine(tiny_llama):
    from quantkit.bench.fused_step import unfused
    from quantkit.engine import LLM, sampler

    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    limit, argmax = llm.engine.model.rope_limit, sampler.argmax_rows
    with unfused(llm):
        assert llm.engine.model.rope_limit is None and sampler.argmax_rows is not argmax
    assert limit == 64 and llm.engine.model.rope_limit == limit and sampler.argmax_rows is argmax
