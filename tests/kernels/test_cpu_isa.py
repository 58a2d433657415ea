"""The CPU level of the C++ kernels (quantkit.kernels.cpu_isa): the pure rule over CPU flags and QUANTKIT_CPU_ISA, and
what a process with each setting loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quantkit.kernels import cpu_isa
from quantkit.kernels.cpu_build import LEVELS, level_named

ZEN3 = frozenset("avx avx2 fma f16c bmi1 bmi2 movbe abm".split())  # AVX2, no AVX-512
ICELAKE = ZEN3 | frozenset("avx512f avx512bw avx512cd avx512dq avx512vl avx512vbmi avx512_vnni".split())  # no BF16
ZEN4 = ICELAKE | frozenset(["avx512_bf16"])
SAPPHIRE = ZEN4 | frozenset("amx_tile amx_bf16 amx_int8".split())


@pytest.mark.parametrize("flags,amx,want", [
    (frozenset(), False, []),  # below AVX2 (or not x86): nothing
    (ZEN3 - {"fma"}, False, []),  # AVX2 without FMA (early VIA, some emulators)
    (ZEN3, False, ["avx2"]),
    (ICELAKE, False, ["avx2", "avx512"]),
    (ZEN4, False, ["avx2", "avx512", "avx512_bf16"]),
    (SAPPHIRE, True, ["avx2", "avx512", "avx512_bf16", "amx"]),
    (SAPPHIRE, False, ["avx2", "avx512", "avx512_bf16"]),  # AMX in the CPU, but Linux did not grant the tiles
])
def test_runnable_levels_follow_the_cpu_flags_and_the_amx_grant(flags, amx, want):
    assert [lv.name for lv in cpu_isa.runnable_levels(flags, amx)] == want


def test_the_highest_runnable_level_is_chosen_and_the_why_says_so():
    choice = cpu_isa.choose(cpu_isa.runnable_levels(ZEN4, False), None)
    assert choice.level.name == choice.machine.name == "avx512_bf16" and "highest level" in choice.why


@pytest.mark.parametrize("requested,want", [("avx2", "avx2"), ("AVX512", "avx512"), (" avx512_bf16 ", "avx512_bf16"),
                                            ("amx", "avx512_bf16")])  # amx asked for on a Zen 4: capped, said
def test_quantkit_cpu_isa_caps_the_level_never_above_the_cpu(requested, want):
    choice = cpu_isa.choose(cpu_isa.runnable_levels(ZEN4, False), requested)
    assert choice.level.name == want and choice.machine.name == "avx512_bf16"
    if requested.strip().lower() != want:
        assert "above what this CPU runs" in choice.why


@pytest.mark.parametrize("requested,words", [("none", "torch's ops"), ("avx9", "is not one of"), ("sse4", "is not one of")])
def test_none_or_an_unknown_value_keeps_torch_ops_with_one_line(requested, words):
    choice = cpu_isa.choose(cpu_isa.runnable_levels(SAPPHIRE, True), requested)
    assert choice.level is None and words in choice.why and "\n" not in choice.why and choice.name == "none"


def test_a_cpu_without_avx2_keeps_torch_ops_and_says_why():
    choice = cpu_isa.choose((), None)
    assert choice.level is None and "no AVX2 + FMA" in choice.why
    assert cpu_isa.choose((), "avx2").level is None


def test_levels_are_cumulative():
    """Each level runs everything the one below it does: a higher level's CPU flags include the lower's."""
    for lower, higher in zip(LEVELS, LEVELS[1:]):
        assert set(lower.cpu_flags) <= set(higher.cpu_flags)
    assert level_named("amx").needs_amx_permission and not level_named("avx512_bf16").needs_amx_permission


@pytest.mark.parametrize("value", ["avx2", "none", "bogus"])
def test_a_process_loads_at_the_level_the_environment_asks(value):
    """In a child process (the level is read once per process): `quantkit env --json` reports the level, and with
    none or a bogus value every kernel is off with the reason."""
    env = {**os.environ, "QUANTKIT_CPU_ISA": value}
    out = subprocess.run([sys.executable, "-m", "quantkit.cli", "env", "--json"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    if value == "avx2":
        if "avx2" not in [lv.name for lv in cpu_isa.runnable_levels(cpu_isa.cpu_flags(), False)]:
            pytest.skip("this CPU has no AVX2")
        assert report["cpu_level"] == "avx2" and "QUANTKIT_CPU_ISA=avx2" in report["cpu_level_why"]
        assert {k["kernel"]: k["active"] for k in report["kernels"]}["int4 linear"]
    else:
        assert report["cpu_level"] == "none" and not any(k["active"] for k in report["kernels"])
        assert all("no CPU level" in k["detail"] for k in report["kernels"])
