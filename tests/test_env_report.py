"""`quantkit env`: versions, the CPU level and why, each CPU kernel on or off, and the engine's start-up line."""

from __future__ import annotations

import contextlib
import json

from quantkit.env_report import collect
from quantkit.kernels import cpu_ext
from tests_support.cli import run_cli

KERNELS = ["int4 linear", "bf16 linear", "int8 lm_head", "W4A8 linear", "paged attention", "fused ops"]


def test_the_report_names_every_kernel_and_the_level_this_process_runs():
    report = collect()
    assert [k["kernel"] for k in report.kernels] == KERNELS
    level = cpu_ext.active_level()
    assert report.cpu_level == (level.name if level else "none") and report.cpu_level_why
    assert set(report.versions) >= {"quantkit", "torch", "transformers", "triton"}
    assert all(isinstance(present, bool) for present in report.cpu_flags.values()) and "avx2" in report.cpu_flags
    for k in report.kernels:  # on with the path it takes, or off with why: never a blank
        assert k["detail"].strip()


def test_a_level_without_a_kernel_says_which_level_it_needs():
    with cpu_ext.at_level("avx2"):
        report = collect()
    off = {k["kernel"]: k["detail"] for k in report.kernels if not k["active"]}
    assert "avx512_bf16" in off["W4A8 linear"]
    on = {k["kernel"]: k["detail"] for k in report.kernels if k["active"]}  # the int8 lm_head: fp32 from AVX2 on
    assert on.get("int8 lm_head") == "AVX2 (fp32 activations)" or "int4 linear" in off


def test_the_linear_kernel_table_is_printed_as_it_chooses():
    """One row chosen per activation dtype, the one QuantLinear would take; at the avx2 level bf16 activations
    go to the AVX2 kernel, each AVX-512 row saying it is not built there."""
    import torch

    from quantkit.kernels.linear_choice import LinearCase, choose

    for level, bf16_row in (("avx2", "int4 (quantkit AVX2 kernel)"), (None, None)):
        with cpu_ext.at_level(level) if level else contextlib.nullcontext():
            report = collect()
            for dtype, rows in report.linear_choice.items():
                chosen = [name for name, verdict in rows if verdict == "chosen"]
                assert chosen == [choose(LinearCase(4, 128, getattr(torch, dtype))).cpu_path]
                assert all(verdict for _, verdict in rows)
            if bf16_row:
                rows = dict(report.linear_choice["bfloat16"])
                if cpu_ext.active_level() is not None:
                    assert rows[bf16_row] == "chosen"
                    assert "not built at this CPU level" in rows["int4 (quantkit AVX-512 BF16 kernel)"]


def test_the_prompt_arithmetic_is_the_engines_default():
    import torch

    from quantkit.engine.weights import int8_prefill_wanted

    for level in ("avx2", None):
        with cpu_ext.at_level(level) if level else contextlib.nullcontext():
            said = collect().prompt_arithmetic
            for dtype in (torch.bfloat16, torch.float32):
                how = said[str(dtype).removeprefix("torch.")]
                assert (how == "W4A8") == int8_prefill_wanted(None, False, True, dtype)
            if level == "avx2":  # the AVX2 W4A8 kernel takes fp32 activations only
                assert said["bfloat16"].startswith("W4A16 (") and "not built" in said["bfloat16"]
                assert said["float32"] == "W4A8"


def test_the_weight_pages_follow_the_thp_mode():
    from quantkit.engine.huge_pages import thp_unavailable

    said = collect().weight_pages
    why = thp_unavailable()
    assert said == "transparent huge pages" if why is None else said == f"4 KiB pages ({why})"


def test_the_command_prints_it_and_json_parses():
    code, text = run_cli("env")
    assert code == 0 and "CPU level:" in text and "paged attention" in text and "linear_choice.py" in text
    assert "prompt tokens by default bfloat16 W4A" in text and "float32 W4A" in text
    assert "engine weights on CPU: " in text
    code, out = run_cli("env", "--json")
    assert code == 0 and [k["kernel"] for k in json.loads(out)["kernels"]] == KERNELS


def test_the_engine_start_up_line_says_the_level_and_each_kernel(stories_dir, caplog):
    from quantkit.engine import LLM

    with caplog.at_level("INFO", logger="quantkit.engine"):
        LLM(str(stories_dir), max_model_len=64, max_num_seqs=2)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU kernels at "))
    assert all(f"{kernel} o" in line for kernel in KERNELS)
