"""Tests of the benchmarks in the top-level benchmarks/ folder (not packaged): its scripts import each other by
module name, as they do when run as `python benchmarks/NAME.py`."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
