"""The vLLM fast-path lines `quantkit check` and the end of `quantize` print (rules: format/vllm_paths.py)."""

from __future__ import annotations

from pathlib import Path

from quantkit.commands.common import console
from quantkit.errors import QuantkitError
from quantkit.format.vllm_paths import FastPathReport, fast_path_report

SHOWN = 5  # layers named per reason


def parse_tps(text: str) -> tuple[int, ...]:
    """'2,4,8' -> (2, 4, 8)."""
    try:
        tps = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        tps = (0,)
    if any(t < 1 for t in tps):
        raise QuantkitError(f"--tp {text!r}: expected comma-separated degrees, e.g. 2,4,8")
    return tps


def fast_path_for(path: str | Path, tps: tuple[int, ...]) -> FastPathReport:
    from quantkit.model.quant_format import packed_shapes
    from quantkit.model.source import open_model

    source = open_model(path)
    info = source.quant
    if info is None:
        raise QuantkitError(f"{source.path}: not a quantized checkpoint (config.json has no quantization_config)")
    reader = source.reader
    try:
        return fast_path_report(packed_shapes(reader, info), tps)
    finally:
        reader.close()


def _by_reason(problems: dict[str, str]) -> list[str]:
    groups: dict[str, list[str]] = {}
    for name, reason in problems.items():
        groups.setdefault(reason, []).append(name)
    lines = []
    for reason, names in groups.items():
        more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
        lines.append(f"{reason}: {', '.join(names[:SHOWN])}{more}")
    return lines


def print_fast_paths(report: FastPathReport) -> None:
    total, slow = len(report.marlin), report.fallbacks
    console.print(f"vLLM: {total - len(slow)} of {total} packed layers take the Marlin kernels", highlight=False, soft_wrap=True)
    for line in _by_reason(slow):
        console.print(f"  falls back ({line})", highlight=False, soft_wrap=True)
    for tp, problems in report.tp.items():
        if not problems:
            console.print(f"  tp {tp}: every layer splits on group boundaries and keeps its kernel", highlight=False, soft_wrap=True)
        for line in _by_reason(problems):
            console.print(f"  tp {tp}: {line}", highlight=False, soft_wrap=True)
