"""quantkit.cli: every command registered by a plain import; the CLI's import stays light."""

import subprocess
import sys

from typer.testing import CliRunner

from quantkit.cli import build_app


def test_help_lists_every_command():
    result = CliRunner().invoke(build_app(), ["--help"])
    assert result.exit_code == 0
    for name in ("quantize", "generate", "check", "demo", "eval"):
        assert name in result.output


def test_importing_the_cli_loads_no_torch():
    code = "import sys, quantkit.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
