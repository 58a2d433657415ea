"""This process's peak resident set (VmHWM) in tests: reset it, then read how far an operation raised it (Linux)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def reset_peak_rss_kib() -> int:
    """Reset this process's peak RSS (VmHWM) to its RSS now (Linux 4.0+: clear_refs 5); returns it. Skips the test
    where the kernel cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    return peak_rss_kib()


def peak_rss_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))
