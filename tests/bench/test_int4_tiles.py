"""The int4 tile benchmark's argument checks: rows that the chosen switch does not reach are refused before any model
loads (the run itself is a benchmark, not a test)."""

import sys

import pytest

from quantkit.bench import int4_tiles
from quantkit.kernels import int4_cpu


@pytest.mark.skipif(int4_cpu.extension() is None or not hasattr(int4_cpu.extension(), "set_eight_columns"),
                    reason="the int4 kernel's bf16 tiles need AVX-512 BF16 (none here)")
@pytest.mark.parametrize(("switch", "rows", "why"), [
    ("tiles", "4", "3-7 run neither of the two tiles"),
    ("eight-columns", "2", "1-2 rows run lane_tile"),
])
def test_rows_the_switch_does_not_reach_are_refused(monkeypatch, capsys, tmp_path, switch, rows, why):
    monkeypatch.setattr(sys, "argv", ["int4_tiles", "--models-dir", str(tmp_path), "--switch", switch, "--ms", rows])
    with pytest.raises(SystemExit) as exc:
        int4_tiles.main()
    assert exc.value.code == 2 and why in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before a checkpoint was made
