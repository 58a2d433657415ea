"""`quantkit-lm-eval ...`: lm-eval's own command line with the `quantkit` model registered.

lm-eval 0.4.13 finds models only in its registry (no plugin entry points), so a backend
registers itself when its module is imported. This wrapper imports ours, then hands the
arguments to lm-eval unchanged:
    quantkit-lm-eval run --model quantkit --model_args pretrained=DIR --tasks mmlu
"""

from __future__ import annotations


def main() -> None:
    import quantkit.eval.lm_backend  # noqa: F401  (registers "quantkit" with lm-eval)
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
