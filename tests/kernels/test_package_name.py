"""The top-level kernels/ folder is quantkit.kernels; a Python started in the repository root also sees it as a
top-level `kernels`, the name of Hugging Face's PyPI package that transformers (5.25 on) imports. Imported under
that name, the folder hands over to that package where it is installed (else it stays the folder, as before
transformers 5.25), so models load from the repository root either way."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def in_repo_root(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def pypi_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_top_level_kernels_is_the_pypi_package_where_installed():
    run = in_repo_root("import kernels; print(kernels.__file__)")
    assert run.returncode == 0, run.stderr
    ours = Path(run.stdout.strip()).resolve().is_relative_to(REPO / "kernels")
    assert ours is not pypi_kernels_installed()


def test_transformers_loads_a_llama_config_from_the_repository_root():
    run = in_repo_root("from transformers import LlamaConfig; import transformers.activations; "
                       "import quantkit.kernels as k; print(LlamaConfig.model_type, k.w4a16_matmul.__name__)")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["llama", "w4a16_matmul"]
