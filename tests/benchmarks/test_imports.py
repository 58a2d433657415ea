"""Every name a benchmark imports from quantkit exists: benchmarks import inside their functions, so a renamed or
removed name breaks a benchmark only when someone runs it (benchmarks/int4_cpu.py's --cold-copies and
benchmarks/int8_activations.py were both broken that way). Read from the source, not run."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "quantkit" / "bench").glob("*.py")])


def quantkit_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from quantkit... import name` in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "quantkit":
            out += [(node.lineno, node.module, alias.name) for alias in node.names]
    return out


def missing(module: str, name: str) -> bool:
    mod = importlib.import_module(module)
    if hasattr(mod, name):
        return False
    try:  # a submodule (from quantkit.kernels import int4_cpu)
        importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        return True
    return False


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_quantkit_name_a_benchmark_imports_exists(path):
    broken = [f"line {line}: from {module} import {name}" for line, module, name in quantkit_imports(path)
              if missing(module, name)]
    assert not broken, f"{path.name}: " + "; ".join(broken)


def test_the_reader_sees_imports_inside_functions(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("def main():\n    from quantkit.kernels.int4_cpu import no_such_name, repack\n")
    found = quantkit_imports(script)
    assert found == [(2, "quantkit.kernels.int4_cpu", "no_such_name"), (2, "quantkit.kernels.int4_cpu", "repack")]
    assert missing("quantkit.kernels.int4_cpu", "no_such_name")
    assert not missing("quantkit.kernels.int4_cpu", "repack")
    assert not missing("quantkit.kernels", "int4_cpu")
