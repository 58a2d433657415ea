"""Running the quantkit CLI in-process."""

from __future__ import annotations

from typer.testing import CliRunner

from quantkit.cli import build_app


def run_cli(*args: str):
    """(exit_code, combined output) of `quantkit ARGS`."""
    result = CliRunner().invoke(build_app(), [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def synthetic_calib(path) -> str:
    from quantkit.calibration.synthetic import make_corpus

    path.write_text("\n\n".join(make_corpus(200, seed=3)))
    return str(path)
