"""The table of quantkit.bench.vs_llmcompressor's runs: rows of separate runs joined, one line per run (ratio to
float, fidelity, seconds, time ratios, peak RSS per tool) and, over several seeds, a mean line per model and method."""

from __future__ import annotations

from quantkit.bench.vs_llmcompressor import PEER_KEYS, TOOLS, check_hashes


def merge_rows(rows: list[dict]) -> list[dict]:
    """Rows of separate runs (one tool each) joined by (model, method, seed); the calibration hashes checked."""
    merged: dict[tuple, dict] = {}
    for r in rows:
        seed = r.get("seed", 0)
        m = merged.setdefault((r["model"], r["method"], seed), {"model": r["model"], "method": r["method"], "seed": seed})
        for tool in TOOLS:
            if tool in r:
                m[tool] = {**r[tool], "load_avg": r.get("load_avg")}
    for m in merged.values():
        check_hashes(m)
    return list(merged.values())


def _cell(side: dict | None, fmt: str, key: str = "wall_s") -> str:
    """`side`'s figures by `fmt`; "-" where that tool did not run or did not measure `key`."""
    return "-" if side is None or side.get(key) is None else fmt.format(**side)


FIDELITY = {"kl": ("KL x1e-3", 1e3, "{:.3f}"), "top1": ("top-1 %", 100, "{:.2f}")}  # field: header, unit, format


def _fidelity_cells(sides: list[dict | None]) -> list[str]:
    """Per FIDELITY field, per tool: the mean over `sides` that carry it, "-" where none does (logs older than
    the fidelity figures, or a tool that did not run)."""
    cells = []
    for key, (_, unit, fmt) in FIDELITY.items():
        for tool in TOOLS:
            values = [side[tool][key] for side in sides if side and key in side.get(tool, {})]
            cells.append(fmt.format(unit * sum(values) / len(values)) if values else "-")
    return cells


def _time_ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def header() -> list[str]:
    """The table's header and rule: per tool its ratio to float, its mean KL from float and top-1 agreement, then
    per tool its seconds, then our time over each peer's, then the quantkit CLI process, then each tool's peak RSS."""
    cols = ["model", "method", *(f"{TOOLS[t]} ppl (x float)" for t in TOOLS),
            *(f"{TOOLS[t]} {label}" for label, _, _ in FIDELITY.values() for t in TOOLS),
            *(f"{TOOLS[t]} s" for t in TOOLS),
            *(f"time ours/{TOOLS[t]}" for t in PEER_KEYS), "quantkit CLI process s",
            *(f"{TOOLS[t]} peak RSS GiB" for t in TOOLS)]
    return ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]


def table_lines(rows: list[dict]) -> list[str]:
    """One line per run; with more than one seed, the seed in the method column and a mean line per
    (model, method) after the runs."""
    seeds = {r.get("seed", 0) for r in rows}
    lines = header()
    for r in rows:
        method = r["method"] if len(seeds) == 1 else f"{r['method']} (seed {r.get('seed', 0)})"
        o = r.get("ours")
        cells = [_cell(r.get(t), "{ppl:.3f} ({ratio:.4f}x)", "ppl") for t in TOOLS]
        cells += _fidelity_cells([r])
        cells += [_cell(r.get(t), "{wall_s:.2f}") for t in TOOLS]
        cells += [_time_ratio(o and o["wall_s"], r.get(t, {}).get("wall_s")) for t in PEER_KEYS]
        cells.append(str(o["process_s"]) if o and "process_s" in o else "-")
        cells += [_cell(r.get(t), "{peak_rss_gib:.2f}", "peak_rss_gib") for t in TOOLS]
        lines.append(f"| {r['model']} | {method} | " + " | ".join(cells) + " |")
    return lines + (mean_lines(rows) if len(seeds) > 1 else [])


def print_table(rows: list[dict]) -> None:
    print("\n".join(table_lines(rows)))


def mean_lines(rows: list[dict]) -> list[str]:
    """Table lines with each (model, method)'s mean over its seeds: ratio to float (min-max in
    brackets) and seconds, per tool."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["method"]), []).append(r)
    lines = []
    for (model, method), runs in groups.items():
        cells, walls = [], {}
        for tool in TOOLS:
            sides = [r[tool] for r in runs if tool in r]
            if not sides:
                cells.append("-")
                continue
            ratios = [x["ratio"] for x in sides if x.get("ratio") is not None]  # none for a real shape
            walls[tool] = sum(x["wall_s"] for x in sides) / len(sides)
            cells.append(f"{sum(ratios) / len(ratios):.4f}x ({min(ratios):.4f}-{max(ratios):.4f})" if ratios else "-")
        cells += _fidelity_cells(runs)
        cells += [f"{walls[t]:.2f}" if t in walls else "-" for t in TOOLS]
        cells += [_time_ratio(walls.get("ours"), walls.get(t)) for t in PEER_KEYS]
        lines.append(f"| {model} | **{method}, mean of {len(runs)} seeds** | " + " | ".join(cells) + " | - |"
                     + " - |" * len(TOOLS))
    return lines
