"""`quantkit-lm-eval ...`: lm-eval's own command line with the `quantkit` model registered.

lm-eval 0.4.13 finds models only in its registry (no plugin entry points), so a backend
registers itself when its module is imported. This wrapper imports ours, then hands the
arguments to lm-eval unchanged:
    quantkit-lm-eval run --model quantkit --model_args pretrained=DIR --tasks mmlu
except that without --device it asks for "auto" (the device that is there), since lm-eval's
own default, cuda:0, dies on a machine without CUDA.
"""

from __future__ import annotations


def main() -> None:
    import quantkit.eval.lm_backend  # noqa: F401  (registers "quantkit" with lm-eval)
    import sys

    import lm_eval.__main__

    if not any(arg == "--device" or arg.startswith("--device=") for arg in sys.argv[1:]):
        sys.argv = [*sys.argv, "--device", "auto"]
    lm_eval.__main__.cli_evaluate()
