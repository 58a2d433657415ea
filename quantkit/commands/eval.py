"""`quantkit eval QUANTIZED --base BASE`: MMLU (through lm-eval) and perplexity for both, and the delta."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from quantkit.commands.common import console, one_line_errors
from quantkit.errors import QuantkitError

if TYPE_CHECKING:
    from quantkit.model.source import ModelSource


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)


@one_line_errors
def eval_command(
    quantized: str = typer.Argument(..., help="The quantized checkpoint (loaded through quantkit's QuantLinear)."),
    base: str = typer.Option(..., "--base", help="The original float checkpoint (folder or hub id)."),
    tasks: str = typer.Option("mmlu,ppl", "--tasks", help="Comma-separated: mmlu, ppl."),
    mmlu_dir: Path | None = typer.Option(None, "--mmlu-dir", help="Local MMLU folder with test/ and dev/ CSVs "
                                         "(default: lm-eval's mmlu from the hub)."),
    subjects: str | None = typer.Option(None, "--subjects", help="Comma-separated MMLU subjects (default: all)."),
    num_fewshot: int = typer.Option(5, "--num-fewshot", help="Few-shot examples per question (from dev)."),
    limit: int | None = typer.Option(None, "--limit", help="As lm-eval's --limit, for quick checks: MMLU questions "
                                     "per subject, and perplexity over the first N windows (default: all)."),
    ppl_text: str = typer.Option("wikitext2", "--ppl-text", help="Text file for perplexity, or 'wikitext2' "
                                 "(wikitext-2-raw-v1 test from the hub)."),
    seqlen: int = typer.Option(2048, "--seqlen", help="Perplexity window length (tokens; clipped to "
                                "the models' context, and the report says so)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per forward pass."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (float16 on CUDA, float32 on CPU), float32, bfloat16."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:N."),
    output: Path | None = typer.Option(None, "--output", help="Write the report as JSON here."),
    max_drop: float | None = typer.Option(None, "--max-drop", help="Fail (exit 1) if MMLU drops more points."),
    max_ppl_ratio: float | None = typer.Option(None, "--max-ppl-ratio", help="Fail (exit 1) above this ppl ratio."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help="Base-result cache (default ~/.cache/quantkit/eval)."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Evaluate the base even if a cached result exists."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="CPU threads for torch (default: torch's "
                                       "choice; 1 is fastest for tiny models on a busy machine)."),
    cpu_int8_lm_head: bool = typer.Option(False, "--cpu-int8-lm-head", help="Hold QUANTIZED's float lm_head in "
                                          "int8, as `serve` does on CPU by default (CPU, --dtype bfloat16 or float32). "
                                          "Off: the checkpoint's own arithmetic, as vLLM and transformers run it."),
    allow_unquantized: bool = typer.Option(False, "--allow-unquantized", help="Evaluate QUANTIZED even when its "
                                           "config.json has no quantization_config (two float models)."),
    allow_mismatched_base: bool = typer.Option(False, "--allow-mismatched-base", help="Evaluate even when --base is "
                                               "not the model QUANTIZED was made from (other architecture, shapes, "
                                               "tokenizer or, from quantkit_meta.json, weights): a warning, not an "
                                               "error."),
) -> None:
    """Evaluate QUANTIZED against --base: MMLU accuracy per category, perplexity, and the delta."""
    from quantkit.devices import resolve_device
    from quantkit.eval.cache import default_cache_dir
    from quantkit.eval.settings import EvalSettings

    quiet_third_party()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    device = str(resolve_device(device))
    settings = EvalSettings(
        tasks=tuple(t.strip() for t in tasks.split(",") if t.strip()), mmlu_dir=mmlu_dir,
        subjects=tuple(s.strip() for s in (subjects or "").split(",") if s.strip()), num_fewshot=num_fewshot,
        limit=limit, ppl_text=ppl_text, seqlen=seqlen, batch_size=batch_size,
        dtype=("float16" if device.startswith("cuda") else "float32") if dtype == "auto" else dtype, device=device,
        cache_dir=None if no_cache else (cache_dir or default_cache_dir()), cpu_int8_lm_head=cpu_int8_lm_head,
    )
    report, failures = run(quantized, base, settings, max_drop, max_ppl_ratio, allow_unquantized, allow_mismatched_base)
    if output is not None:
        write_json(output, report.to_json())
        console.print(f"report written to {output}")
    for failure in failures:
        console.print(f"[bold red]gate failed:[/] {failure}", highlight=False, soft_wrap=True)
    if failures:
        raise typer.Exit(1)


def run(quantized: str, base: str, settings, max_drop, max_ppl_ratio, allow_unquantized: bool = False,
        allow_mismatched_base: bool = False):
    from contextlib import nullcontext
    from dataclasses import asdict

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from quantkit.eval.report import EvalReport, Gate, render_table
    from quantkit.eval.runner import Bars
    from quantkit.eval.runner import clip_seqlen, evaluate_model, resolve_inputs
    from quantkit.model.source import open_model
    from quantkit.progress import no_lm_eval_bars

    quantized, base = open_model(quantized), open_model(base)  # each resolved and read once for the whole run
    what = quantized_kind(quantized, allow_unquantized)
    notes = matched_base(quantized, base, allow_mismatched_base)
    inputs = resolve_inputs(settings)
    requested = settings.seqlen
    if "ppl" in settings.tasks:
        settings, clipped = clip_seqlen(settings, (base, quantized))
        notes += [clipped] if clipped else []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    quiet = no_lm_eval_bars() if "mmlu" in settings.tasks else nullcontext()  # ppl alone never imports lm-eval
    with Progress(*columns, console=console, transient=False) as bar, quiet:
        base_run = evaluate_model("base", base, settings, inputs, Bars(bar))
        quant_run = evaluate_model("quantized", quantized, settings, inputs, Bars(bar))
    described = {"quantized_checkpoint": what, "seqlen_requested": requested}
    report = EvalReport(base_run, quant_run, settings_dict(asdict(settings), inputs) | described,
                        notes + run_notes(settings, inputs, base_run, quant_run))
    from rich.console import Console

    Console().print(render_table(report))
    for note in report.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    return report, Gate(max_drop, max_ppl_ratio).failures(report.to_json()["delta"])


def quantized_kind(quantized: ModelSource, allow_unquantized: bool) -> str:
    """What QUANTIZED is; a float folder is refused unless allowed (a gate on it would measure nothing)."""
    from quantkit.eval.runner import NOT_QUANTIZED, checkpoint_quantization

    what = checkpoint_quantization(quantized)
    if what == NOT_QUANTIZED and not allow_unquantized:
        raise QuantkitError(f"{quantized.name}: not quantized (config.json has no quantization_config), so the delta "
                            f"would compare two float models; pass --allow-unquantized to do that anyway")
    return what


def matched_base(quantized: ModelSource, base: ModelSource, allowed: bool) -> list[str]:
    """Refuse a --base that QUANTIZED was not made from (the delta would compare two unrelated models), unless
    allowed: then a warning, and the report's notes say so."""
    from quantkit.eval.base_match import base_mismatches

    found = base_mismatches(quantized, base)
    if not found:
        return []
    if not allowed:
        raise QuantkitError(f"{quantized.name} was not quantized from {base.name}: {'; '.join(found)}; pass "
                            f"--allow-mismatched-base to compare them anyway")
    console.print(f"[yellow]warning:[/] comparing with a base {quantized.name} was not quantized from "
                  f"(--allow-mismatched-base): {'; '.join(found)}", highlight=False, soft_wrap=True)
    return [f"mismatched base (--allow-mismatched-base): {m}" for m in found]


def run_notes(settings, inputs, base_run, quant_run) -> list[str]:
    notes = []
    skipped = [t for t in ("mmlu", "ppl") if t not in settings.tasks]
    if skipped:
        notes.append(f"skipped: {', '.join(skipped)} (not in --tasks)")
    if inputs.subjects and len(inputs.subjects) < inputs.available_subjects:
        notes.append(f"MMLU: {inputs.available_subjects - len(inputs.subjects)} of {inputs.available_subjects} "
                     "subjects skipped (--subjects)")
    if inputs.subjects and settings.limit is not None:
        notes.append(f"MMLU: at most {settings.limit} questions per subject (--limit)")
    if "ppl" in settings.tasks and settings.limit is not None:
        notes.append(f"perplexity: at most the first {settings.limit} windows (--limit)")
    if base_run.cached:
        notes.append(f"base {', '.join(base_run.cached)} from the cache (pass --no-cache to re-run)")
    for run in (base_run, quant_run):
        if run.mmlu is not None and run.mmlu.truncated:
            notes.append(f"{run.role}: {run.mmlu.truncated} MMLU contexts longer than the model's window "
                         "were truncated from the left")
    if quant_run.ppl is not None:
        notes.append(f"perplexity protocol: {quant_run.ppl.protocol.describe()}")
    return notes


def settings_dict(raw: dict, inputs) -> dict:
    out = {k: (str(v) if isinstance(v, Path) else v) for k, v in raw.items()}
    out["tasks"] = list(raw["tasks"])
    out["subjects"] = inputs.subjects
    return out


def quiet_third_party() -> None:
    """lm-eval logs a warning per truncated request: quiet. TQDM_DISABLE silences the tqdm bars of libraries that
    import tqdm after this (datasets' downloads); lm-eval's own bars are turned off by `no_lm_eval_bars`."""
    import logging
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    logging.getLogger("lm-eval").setLevel(logging.ERROR)


def write_json(path: Path, data: dict) -> None:
    import json
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
