"""The delta report: metrics per model, base-vs-quantized deltas, the JSON file, the rich table, the gate.

JSON layout: {"base": {...}, "quantized": {...}, "delta": {...}, "settings": {...}, "runtime": {...},
"notes": [...]}; base / quantized / delta map metric names (`mmlu_acc`, `mmlu_acc_<category>`,
`ppl`, and `*_stderr`) to numbers. Accuracies are fractions in [0, 1]; the gate's --max-drop is
in MMLU points (percentage points), as people quote MMLU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from quantkit.eval.mmlu import CATEGORIES, MmluResult, mean_and_stderr
from quantkit.eval.runner import ModelRun


def model_metrics(run: ModelRun) -> dict[str, float]:
    out: dict[str, float] = {}
    if run.mmlu is not None:
        for category in (None, *CATEGORIES):
            values = [float(c) for c in run.mmlu.correct(category)]
            if not values:
                continue
            name = "mmlu_acc" if category is None else f"mmlu_acc_{category}"
            out[name], out[f"{name}_stderr"] = mean_and_stderr(values)
    if run.ppl is not None:
        out["ppl"] = run.ppl.ppl
    return out


def paired_delta(base: MmluResult, quant: MmluResult, category: str | None) -> tuple[float, float]:
    """quantized - base accuracy and the stderr of the per-question difference (same questions)."""
    b, q = base.correct(category), quant.correct(category)
    if len(b) != len(q):
        raise ValueError("base and quantized MMLU results cover different questions")
    return mean_and_stderr([float(y) - float(x) for x, y in zip(b, q)])


def delta_metrics(base: ModelRun, quant: ModelRun) -> dict[str, float]:
    out: dict[str, float] = {}
    if base.mmlu is not None and quant.mmlu is not None:
        for category in (None, *CATEGORIES):
            if not base.mmlu.correct(category):
                continue
            name = "mmlu_acc" if category is None else f"mmlu_acc_{category}"
            out[name], out[f"{name}_stderr"] = paired_delta(base.mmlu, quant.mmlu, category)
    if base.ppl is not None and quant.ppl is not None:
        out["ppl"] = quant.ppl.ppl - base.ppl.ppl
        out["ppl_ratio"] = quant.ppl.ppl / base.ppl.ppl
    return out


@dataclass
class EvalReport:
    base: ModelRun
    quantized: ModelRun
    settings: dict
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "base": model_metrics(self.base),
            "quantized": model_metrics(self.quantized),
            "delta": delta_metrics(self.base, self.quantized),
            "settings": self.settings,
            "runtime": {run.role: runtime(run) for run in (self.base, self.quantized)},
            "notes": self.notes,
        }


def runtime(run: ModelRun) -> dict:
    out = {"path": run.path, "quantization": run.quantization, "wall_s": run.wall_s,
           "memory_bytes": run.memory_bytes, "cached_tasks": run.cached}
    if run.mmlu is not None:
        out["mmlu_truncated_contexts"] = run.mmlu.truncated
    if run.ppl is not None:
        out["ppl_protocol"] = run.ppl.protocol.describe()
    return out


@dataclass(frozen=True)
class Gate:
    max_drop: float | None = None  # MMLU points
    max_ppl_ratio: float | None = None

    def failures(self, delta: dict[str, float]) -> list[str]:
        out = []
        if self.max_drop is not None and "mmlu_acc" in delta:
            drop = -100.0 * delta["mmlu_acc"]
            if drop > self.max_drop:
                out.append(f"MMLU dropped {drop:.2f} points (limit --max-drop {self.max_drop:g})")
        if self.max_ppl_ratio is not None and "ppl_ratio" in delta:
            if delta["ppl_ratio"] > self.max_ppl_ratio:
                out.append(f"perplexity ratio {delta['ppl_ratio']:.4f} (limit --max-ppl-ratio {self.max_ppl_ratio:g})")
        return out


def fmt_acc(value: float | None, stderr: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    text = f"{100 * value:+.2f}" if signed else f"{100 * value:.2f}"
    return text if stderr is None or math.isnan(stderr) else f"{text} ± {100 * stderr:.2f}"


def fmt_mib(n: int) -> str:
    return "-" if n == 0 else f"{n / 2**20:.2f}"  # 0: nothing loaded (served from the cache)


def render_table(report: EvalReport):
    """A rich Table: MMLU rows per category (points), perplexity, wall time and memory."""
    from rich.table import Table

    data = report.to_json()
    base, quant, delta = data["base"], data["quantized"], data["delta"]
    what = report.settings.get("quantized_checkpoint")
    table = Table(title="quantkit eval: base vs quantized" + (f" ({what})" if what else ""))
    for column in ("metric", "base", "quantized", "delta"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for category in (None, *CATEGORIES):
        name = "mmlu_acc" if category is None else f"mmlu_acc_{category}"
        if name in base:
            label = "MMLU (all)" if category is None else f"MMLU {category.replace('_', ' ')}"
            table.add_row(label, fmt_acc(base[name], base.get(f"{name}_stderr")),
                          fmt_acc(quant.get(name), quant.get(f"{name}_stderr")),
                          fmt_acc(delta.get(name), delta.get(f"{name}_stderr"), signed=True))
    if "ppl" in base:
        table.add_row("perplexity", f"{base['ppl']:.4f}", f"{quant['ppl']:.4f}", f"x{delta['ppl_ratio']:.4f}")
    rt = data["runtime"]
    table.add_row("wall time (s)", f"{rt['base']['wall_s']:.1f}" + (" (cached)" if rt["base"]["cached_tasks"] else ""),
                  f"{rt['quantized']['wall_s']:.1f}", "")
    table.add_row("weights in memory (MiB)", fmt_mib(rt["base"]["memory_bytes"]),
                  fmt_mib(rt["quantized"]["memory_bytes"]), "")
    return table
