"""The kernels' tuning switches are development-only: they live in each extension's `dev` submodule, which only
benchmarks and tests call, never the package (each switch changes process-wide state)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from quantkit.kernels import bf16_cpu, int4_cpu, paged_attention_cpu

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("extension", [int4_cpu.extension, bf16_cpu.extension, paged_attention_cpu.cpu_attention])
def test_every_switch_is_under_dev_and_none_at_the_top(extension):
    mod = extension()
    if mod is None:
        pytest.skip("the extension is not built here")
    assert not [name for name in dir(mod) if name.startswith("set_")]
    assert hasattr(mod.dev, "set_amx") and all(name.startswith("set_") for name in dir(mod.dev) if
                                                not name.startswith("_"))


def test_the_package_never_calls_a_switch():
    calls = re.compile(r"\.dev\.set_\w+\(|\.dev, \"set_")
    users = [str(path.relative_to(REPO)) for folder in ("quantkit", "kernels", "calibration")
             for path in (REPO / folder).rglob("*.py") if calls.search(path.read_text())]
    assert users == []
