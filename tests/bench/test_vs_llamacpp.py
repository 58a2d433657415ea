"""The llama.cpp benchmark: its pure pieces, and (interop marker) one short real run against
llama-cpp-python in ../.venvs/llamacpp (or QUANTKIT_LLAMACPP_VENV), on the tiny Llama. Run it by hand:
    .venv/bin/pytest -q -m interop tests/bench/test_vs_llamacpp.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.bench.llamacpp_ttft import kv_bytes_per_token, random_prompt
from quantkit.bench.vs_llamacpp import PROMPT_LEN, Bound, Run, Tally, common_prefix

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("QUANTKIT_LLAMACPP_VENV", REPO.parent / ".venvs" / "llamacpp"))


def test_common_prefix_counts_leading_agreement():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([5, 6], [5, 6, 7]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([3], [4]) == 0


def test_tally_rates_prefill_from_the_prompt_and_decode_from_the_tokens_after_the_first():
    t = Tally()
    t.add(Run(prefill_s=0.5, decode_s=2.0, tokens=list(range(9))))
    t.add(Run(prefill_s=0.25, decode_s=1.0, tokens=list(range(9))))
    t.add(Run(prefill_s=1.0, decode_s=4.0, tokens=list(range(9))))
    assert t.medians() == (4.0, PROMPT_LEN / 0.5)


def test_each_round_is_held_against_its_own_bound():
    tallies = {"ours": Tally(decode=[10.0]), "peer": Tally(decode=[5.0])}
    bound = Bound({"ours": 2**30, "peer": 2**29}, gib=0.0625)
    line = bound.measure(1, tallies)
    rate, loop = bound.rates[0]
    assert line == f"bound {rate / 1e9:.1f} GB/s, {loop}" and 1e8 < rate < 1e13
    assert loop.startswith("torch's sum, ") or loop.startswith("stream kernel ")
    assert loop.endswith(", 4 KiB pages") or loop.endswith(", huge pages")
    assert bound.fractions == {"ours": [10.0 * 2**30 / rate], "peer": [5.0 * 2**29 / rate]}
    tallies["ours"].decode.append(20.0)
    tallies["peer"].decode.append(5.0)
    bound.measure(1, tallies)
    text = bound.report()
    assert "1024.0 MiB a token" in text and "512.0 MiB a token" in text
    want = (10.0 * 2**30 / bound.rates[0][0] + 20.0 * 2**30 / bound.rates[1][0]) / 2  # the median of two
    assert f"decode at {want:.3g}x the bound" in text


def test_the_kv_cache_of_a_token_is_k_and_v_of_every_layer_in_16_bit(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 16, "num_key_value_heads": 8, "hidden_size": 2048, '
                                          '"num_attention_heads": 32}')
    assert kv_bytes_per_token(tmp_path) == 2 * 16 * 8 * 64 * 2  # Llama-3.2-1B: 32 KiB
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2, "num_key_value_heads": 2, "hidden_size": 64, '
                                          '"num_attention_heads": 4, "head_dim": 32}')
    assert kv_bytes_per_token(tmp_path) == 2 * 2 * 2 * 32 * 2


def test_ttft_prompts_are_fresh_per_seed_and_in_the_vocabulary():
    a, b = random_prompt(512, 1000, 1), random_prompt(512, 1000, 2)
    assert len(a) == 512 and a != b and a == random_prompt(512, 1000, 1) and 3 <= min(a + b) and max(a + b) < 1000


@pytest.mark.interop
@pytest.mark.slow
def test_llamacpp_runs_the_converted_model_like_quantkit(tiny_llama, tmp_path):
    if not (VENV / "bin" / "python").exists():
        pytest.skip(f"no llama-cpp-python venv at {VENV}: python3 -m venv VENV && "
                    "VENV/bin/pip install llama-cpp-python==0.3.36 gguf")
    from quantkit.bench.engine_vs_vllm import make_gptq

    gptq = make_gptq(tiny_llama, tmp_path)
    cmd = [sys.executable, "-m", "quantkit.bench.vs_llamacpp", "--llamacpp-venv", str(VENV), "--model",
           str(tiny_llama), "--gptq", str(gptq), "--rounds", "1", "--quants", "Q4_0", "--threads", "2",
           "--log", str(tmp_path / "llamacpp.log"), "--bound"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    agree = int(re.search(r"agree on the first (\d+) of", out).group(1))
    assert agree >= 16, out  # the F32 conversion computes quantkit's model
    assert "argmax equal" in out
    diff = float(re.search(r"max \|diff\| (\S+) ", out).group(1))
    assert diff < 1e-2, out  # llama.cpp keeps its KV cache in F16 by default; without the q/k reordering
    # the logits differ by O(1)
    for system in ("llama.cpp F32", "llama.cpp Q4_0", "quantkit 4-bit GPTQ"):
        rate = float(re.search(rf"{re.escape(system)}.*? decode +(\S+) tok/s", out).group(1))
        assert rate > 0, out
    assert "decode ratio quantkit 4-bit" in out
    assert "== against the bound: " in out  # --bound: each system's decode against the round's read bandwidth
    for system in ("llama.cpp Q4_0", "quantkit 4-bit GPTQ"):
        assert float(re.search(rf"{re.escape(system)}.*? MiB a token, decode at (\S+)x the bound", out).group(1)) > 0


@pytest.mark.interop
@pytest.mark.slow
def test_llamacpps_own_ngram_speculation_keeps_greedy_tokens(tiny_llama, tmp_path):
    if not (VENV / "bin" / "python").exists():
        pytest.skip(f"no llama-cpp-python venv at {VENV}")
    from quantkit.bench.gguf_export import write_gguf
    from quantkit.bench.vs_llamacpp import llamacpp_speculation

    gguf = write_gguf(tiny_llama, tmp_path / "m.gguf", "f32")
    prompt = [5, 9, 14, 23, 5, 9, 14, 23, 5, 9]  # a repeating prompt: the lookup finds drafts
    report = llamacpp_speculation(VENV / "bin" / "python", gguf, {"repeat": {"prompts": [prompt], "temperature": 0.0},
                                                                  "sampled": {"prompts": [prompt], "temperature": 1.0}},
                                  threads=2, k=4, ngram=4, max_tokens=16, rounds=1)
    assert set(report) == {"repeat", "sampled"}
    for r in report.values():
        assert r["same"] is True  # speculation never changes greedy tokens
        assert len(r["plain"]) == len(r["spec"]) == 1 and min(r["plain"] + r["spec"]) > 0
