"""The GPU check's markdown report: one section per step, its figures, or why it has none."""

from __future__ import annotations

TITLES = {
    "tests": "GPU-marked tests (`pytest -m gpu`)",
    "w4a16": "W4A16 kernel benchmark (`python -m quantkit.bench.w4a16`)",
    "model": "Random Llama, TinyLlama-1.1B shapes",
    "gptq": "GPTQ quantization on the GPU",
    "engine": "Engine on the GPU (Triton paged attention)",
}


def _num(value, fmt: str = ".2f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _tests(f: dict) -> list[str]:
    lines = [f"{f['tests']} tests: {f['passed']} passed, {f['failures']} failed, {f['errors']} errors, "
             f"{f['skipped']} skipped, in {f['seconds']:.1f} s."]
    lines += [f"- failed: `{name}`" for name in f["failed"]]
    return lines


def _model(f: dict) -> list[str]:
    return [f"{f['layers']} decoder layers ({f['shape']}): {f['params_m']:.1f} M parameters, "
            f"{f['disk_gib']:.3f} GiB of bf16 on disk, built and saved in {f['seconds']:.1f} s."]


def _gptq(f: dict) -> list[str]:
    return [f"{f['quantized_linears']} linears, 4-bit, group size {f['group_size']}, calibration {f['calib']}.", "",
            "| layers | quantize s | s per layer (mean) | min | max | peak GPU memory GiB | peak RSS GiB |",
            "|---|---|---|---|---|---|---|",
            f"| {f['layers']} | {f['seconds']:.1f} | {f['layer_s_mean']:.2f} | {f['layer_s_min']:.2f} | "
            f"{f['layer_s_max']:.2f} | {_num(f['peak_gpu_gib'])} | {f['peak_rss_gib']:.2f} |"]


def _engine(f: dict) -> list[str]:
    lines = [f["workload"] + ".", "", "| checkpoint | dtype | tokens | seconds | tok/s | paged-attention kernel calls |",
             "|---|---|---|---|---|---|"]
    for name, label in (("model", "float (bf16 on disk)"), ("gptq", "GPTQ 4-bit (W4A16 kernel)")):
        run = f.get(name)
        if run is None:
            continue
        if "error" in run:
            lines.append(f"| {label} | - | - | - | - | failed: {run['error']} |")
        else:
            lines.append(f"| {label} | {run['dtype']} | {run['tokens']} | {run['seconds']:.2f} | "
                         f"{run['tok_s']:.1f} | {run['kernel_calls']} |")
    return lines


SECTIONS = {"tests": _tests, "model": _model, "gptq": _gptq, "engine": _engine,
            "w4a16": lambda f: [f["table"].rstrip()]}


def section(result) -> list[str]:
    lines = [f"## {TITLES[result.name]}", ""]
    if result.figures:
        try:
            lines += SECTIONS[result.name](result.figures)
        except (KeyError, TypeError) as exc:  # a step that died half-way wrote only some figures
            lines.append(f"(figures incomplete: {type(exc).__name__} {exc})")
    else:
        lines.append("No figures.")
    if not result.ok:
        lines += ["", f"**{result.status}**"]
        if result.log_tail:
            lines += ["", "```", result.log_tail, "```"]
    return lines + [""]


def render(env: dict, results: list) -> str:
    dry = env["mode"] == "dry run"
    lines = ["# GPU check", "",
             ("**Dry run**: toy sizes on CPU tensors, Triton kernels in the interpreter; the figures only show "
              "that every step runs." if dry else "Run on a GPU with `bash kernels/gpu_check.sh OUTDIR`."), "",
             f"Device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
             f"Python {env['python']}; commit {env['commit']}; {env['date']}; {env['total_s']:.0f} s in all.", "",
             "| step | status | seconds | budget s |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.1f} | {r.budget_s:.0f} |" for r in results]
    lines.append("")
    for result in results:
        lines += section(result)
    return "\n".join(lines)
