"""quantkit.kernels: W4A16 dequant-matmul, one API over the Triton kernels and the pure-torch reference
(`w4a16_dispatch`), and the CPU kernels in their own modules.

This folder is quantkit.kernels. A Python started in the repository root (`python -m ...`, `python -c ...`) also
finds it as a top-level `kernels`, the name of Hugging Face's PyPI package that transformers imports when it is
installed (transformers 5.25 requires it). Imported under that name, this file hands the import over to that
package where it is installed (`_hand_over`), so transformers gets what it asked for; where it is not, the name
stays this folder, as transformers before 5.25 expected.
"""

from __future__ import annotations

import sys


def _hand_over() -> bool:
    """Load the `kernels` found on sys.path past this repository into sys.modules["kernels"] (the import statement
    returns that entry); False where there is none."""
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)
    return True


if __name__ != "kernels" or not _hand_over():
    from quantkit.kernels.w4a16_dispatch import BACKENDS, w4a16_matmul, w4a16_matmul_reference  # noqa: F401

    __all__ = ["w4a16_matmul", "w4a16_matmul_reference", "BACKENDS"]
