"""`quantkit quantize MODEL`: GPTQ, AWQ or RTN to an INT4 checkpoint vLLM and transformers load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from quantkit.commands.common import console, one_line_errors, staged_output
from quantkit.commands.flags import argument, command, given_flags, option


DEFAULT_CALIB = "wikitext2"


@dataclass(frozen=True)
class QuantizeFlags:
    """`quantkit quantize`'s command line as typed; quantize_config makes it the QuantizeConfig."""

    model: str = argument(None, help="Local Hugging Face checkpoint folder, or a hub id (downloaded when online).")
    out: Path = option(None, "--out", "-o", help="Output folder (written to a temporary folder, then renamed).")
    config: str = option(None, "--config", help="A shipped recipe by name (e.g. gptq-w4g128; see --list-configs) or a TOML file; flags given here win.")
    list_configs: bool = option(False, "--list-configs", help="List the shipped recipes (for --config NAME) and exit.")
    method: str = option("gptq", "--method", help="gptq, awq or rtn.")
    format: str = option(None, "--format", help="Checkpoint layout: gptq, awq or compressed-tensors (pack-quantized; default: awq for AWQ, else gptq).")
    bits: int = option(4, "--bits", help="4 (8 allowed in the GPTQ and compressed-tensors layouts).")
    group_size: int = option(128, "--group-size", help="32, 64, 128, or -1 for per channel.")
    sym: bool = option(None, "--sym/--no-sym", help="Symmetric quantization (default: sym for GPTQ/RTN, asym for AWQ).")
    desc_act: bool = option(False, "--desc-act/--no-desc-act", help="GPTQ act-order: columns by decreasing Hessian diagonal.")
    act_group_aware: bool = option(False, "--act-group-aware/--no-act-group-aware", help="GPTQ group-aware act-order (GAR, GPTQModel's act_group_aware): whole groups by decreasing Hessian diagonal, each group's columns likewise; g_idx stays monotonic, so inference is unchanged. Not with --desc-act.")
    static_groups: bool = option(True, "--static-groups/--no-static-groups", help="GPTQ: each group's scale and zero from the original weights, fixed before the column loop (and before act-order); --no-static-groups takes them from the updated columns when the loop reaches the group.")
    gptaq: bool = option(False, "--gptaq/--no-gptaq", help="GPTQ with asymmetric calibration (GPTAQ, GPTQModel's v2=True): each linear matches the float model's outputs on the float model's inputs, not its own float weights on the quantized model's inputs. Holds a float copy of the layer and of the activations beside the quantized ones (twice the activations' memory). Dense layers only.")
    gptaq_alpha: float = option(0.25, "--gptaq-alpha", help="GPTAQ: the share of the asymmetric correction applied, in (0, 1] (1: the exact objective; 0.25: GPTAQ's and GPTQModel's default).")
    damp: float = option(0.01, "--damp", help="GPTQ damping, a fraction of the Hessian's mean diagonal.")
    true_sequential: bool = option(None, "--true-sequential/--no-true-sequential", help="GPTQ: collect each group's Hessian after the earlier groups of the layer are quantized (one layer run per group) instead of all in one float run of the layer (the default, but with --gptaq).")
    calib: str = option(None, "--calib", help="A .txt (documents split on blank lines) or .jsonl ('text') file, a folder of them, or a recipe: wikitext2 (default), c4, pileval. RTN uses none.")
    nsamples: int = option(128, "--nsamples", help="Calibration windows.")
    seqlen: int = option(2048, "--seqlen", help="Tokens per window (clipped to the model's context).")
    seed: int = option(0, "--seed")
    device: str = option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:N.")
    compute_dtype: str = option("auto", "--compute-dtype",
                                help="dtype of the calibration forward passes: auto (bfloat16 on a GPU with bf16 and on a CPU "
                                     "with AVX-512 BF16 or AMX, else float32), float32 or bfloat16. The quantizers' math stays fp32.")
    scale_search: str = option("minmax", "--scale-search", help="RTN and GPTQ: each group's scale and zero from min-max, or searched: mse (the weight error, data-free), imatrix (the error weighted by the calibration inputs' mean square per channel; RTN then reads --calib), prior (RTN, data-free: weighted by an estimate of that mean square from the model's own norms and weights).")
    awq_duo_scaling: str = option("false", "--awq-duo-scaling", help="AWQ's scale formula per smoothing group: false (activations, x**r), true (activations and weights, x**r / w**(1-r): duo scaling), or both (each searched, the lower loss kept).")
    awq_row_gain: bool = option(True, "--awq-row-gain/--no-awq-row-gain", help="AWQ: after clipping and rounding, scale each output row by the gain that fits its quantized outputs to the float ones on the calibration inputs (least squares; undoes the shrink clipping leaves).")
    awq_search_tokens: int = option(2048, "--awq-search-tokens", min=0, help="AWQ: judge the scale candidates on evenly strided calibration samples up to this many tokens (0: all).")
    load_plan: Path = option(None, "--load-plan", help="AWQ: apply a saved awq_plan.safetensors instead of searching.")
    max_shard_size_gb: float = option(2.0, "--max-shard-size-gb", help="Shard the output above this size.")
    quantize_lm_head: bool = option(False, "--quantize-lm-head/--no-quantize-lm-head", help="Pack lm_head in 4/8 bits too (round to nearest), marked lm_head: true in quantization_config as GPTQModel's lm_head=True writes it; GPTQ layout only.")
    force: bool = option(False, "--force", help="Replace an existing output folder.")
    strict: bool = option(False, "--strict", help="Refuse what is otherwise a warning: too little calibration "
                          "text for the model (fewer tokens than one window per 16 groups of its widest layer).")
    dry_run: bool = option(False, "--dry-run", help="Check the model, config and shapes; write nothing.")
    threads: int = option(None, "--threads", min=1, help="CPU threads for torch (default: torch's choice).")
    low_memory: bool = option(None, "--low-memory/--no-low-memory",
                              help="Give every freed block of 1 MiB or more back to the system at once and trim the heap "
                                   "between layers (glibc), so peak memory does not creep up layer after layer; slower "
                                   "on CPU (page faults). "
                                   "Default: on for models of 1 GiB or more in fp32.")
    check: bool = option(None, "--check/--no-check",
                         help="Run every packed layer through the W4A16 kernel at the end (default: when a GPU is present).")


def register(app: typer.Typer) -> None:
    app.command("quantize")(command(QuantizeFlags, quantize))


@one_line_errors
def quantize(ctx: typer.Context, flags: QuantizeFlags) -> None:
    """Quantize MODEL layer by layer and write a packed INT4 checkpoint."""
    from quantkit.commands.fast_path import fast_path_for, print_fast_paths
    from quantkit.quant.pipeline import quantize_model

    if flags.list_configs:
        _print_recipes()
        return
    cfg, source = quantize_config(flags, given_flags(ctx))
    if flags.dry_run:
        report = quantize_model(cfg, None, source=source)
        _print_plan(report.plan, cfg)
        return
    out = flags.out
    with staged_output(out, flags.force) as tmp:
        report = quantize_model(cfg, tmp, warn=_warn, source=source)
    report.out = out
    _print_summary(report, cfg)
    print_fast_paths(fast_path_for(out, (2, 4, 8)))
    if flags.check or (flags.check is None and _cuda_available()):
        _run_check(out, flags.model, cfg.calib.source if Path(cfg.calib.source).exists() else None)


def quantize_config(flags: QuantizeFlags, given: frozenset[str]):
    """(the one validated QuantizeConfig of this run, the opened model): the values the command line gave
    (`given`: their names), else the recipe's (--config), else the flags' defaults. Sets torch's threads (--threads)
    and, with --low-memory, bounds the heap."""
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.errors import QuantkitError
    from quantkit.model.source import open_model

    p = flags
    if p.model is None or p.out is None:
        raise QuantkitError("quantize needs MODEL and --out (or --list-configs)")
    recipe, o = _options(flags, given)
    source = open_model(p.model)  # resolved and read once for the whole run
    if p.threads:
        import torch

        torch.set_num_threads(p.threads)
    calib = o["calib"]
    calib = CalibConfig(source=DEFAULT_CALIB if calib is None else calib, nsamples=o["nsamples"], seqlen=o["seqlen"],
                        seed=o["seed"])
    same = ("method", "format", "bits", "group_size", "sym", "desc_act", "act_group_aware", "static_groups", "damp",
            "true_sequential", "gptaq", "gptaq_alpha", "awq_duo_scaling", "awq_row_gain", "awq_search_tokens", "scale_search")
    cfg = QuantizeConfig(
        model=p.model, out=p.out, calib=calib, device=p.device, compute_dtype=p.compute_dtype,
        low_memory=_low_memory(p.low_memory, p.dry_run, source), force=p.force, dry_run=p.dry_run,
        max_shard_size=int(o["max_shard_size_gb"] * 1024**3), load_plan=p.load_plan,
        quantize_lm_head=p.quantize_lm_head, recipe=None if recipe is None else recipe.to_dict(), strict=p.strict,
        **{k: o[k] for k in same},
    )
    if o["calib"] is not None and cfg.method == "rtn" and not cfg.search.measures_inputs:
        console.print(f"[yellow]warning:[/] --method rtn uses no calibration data: --calib {o['calib']} is ignored",
                      highlight=False, soft_wrap=True)
    return cfg, source


# oneDNN's and ideep's kernel caches under --low-memory (entries each): an MoE layer's experts each see their own
# routed token count, so every expert adds kernels of new shapes (~0.3 MiB an entry), 0.27 GB of them kept from layer
# 0 into layer 1 on Qwen3-30B-A3B's shape at the default 1024; a dense layer's passes use a dozen shapes
KERNEL_CACHE_ENTRIES = 32


def _low_memory(asked: bool | None, dry_run: bool, source) -> bool:
    """--low-memory as given, else on for models whose weights reach 1 GiB in fp32; when on (and
    something will be written), glibc's heap and the kernel caches are bounded for this process."""
    from quantkit.memory import bound_heap, bound_kernel_caches, low_memory_by_default

    if dry_run:
        return bool(asked)
    on = asked if asked is not None else low_memory_by_default(4 * source.reader.num_elements())
    if on:
        bound_heap()
        bound_kernel_caches(KERNEL_CACHE_ENTRIES)
    return on


def _options(flags: QuantizeFlags, given: frozenset[str]):
    """(recipe, option values): the command line's, else the recipe's, else the defaults."""
    from quantkit.recipes import RECIPE_KEYS, find_recipe, load_recipe, merge

    recipe = None if flags.config is None else load_recipe(find_recipe(flags.config))
    values = {k: getattr(flags, k) for k in RECIPE_KEYS}
    return recipe, merge(recipe, {k: v for k, v in values.items() if k in given}, values)


def _print_recipes() -> None:
    from rich.console import Console
    from rich.table import Table

    from quantkit.recipes import default_config_dir, list_recipes

    folder = default_config_dir()
    table = Table(title=f"recipes in {folder} (quantkit quantize MODEL --config NAME)")
    for col in ("name", "method", "format", "bits", "group", "description"):
        table.add_column(col, no_wrap=col != "description")
    for r in list_recipes(folder):
        v = r.values
        table.add_row(r.name, v["method"], str(v.get("format", "")), str(v.get("bits", 4)), str(v.get("group_size", 128)),
                      r.description)
    Console().print(table)  # a result: stdout


def _warn(message: str) -> None:
    console.print(f"[bold yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _run_check(out: Path, original: str, calib: str | None) -> None:
    """The checking step: kernel against reference on every packed layer, and error against the original."""
    from quantkit.check.checkpoint import check_checkpoint
    from quantkit.errors import QuantkitError

    report = check_checkpoint(out, original=original, calib=calib)
    worst = max((r.rel_error for r in report.layers if r.rel_error is not None), default=None)
    console.print(f"check: {len(report.layers)} packed layers through backend {report.backend}; "
                  f"{'passed' if report.passed else 'FAILED'}" + ("" if worst is None else f", worst relative error {worst:.4f}"))
    if not report.passed:
        names = ", ".join(r.name for r in report.failures[:3])
        raise QuantkitError(f"the check failed on {len(report.failures)} layers ({names}); "
                            f"run `quantkit check {out} --original {original}` for the table")


def _print_plan(plan, cfg) -> None:
    console.print(f"[bold]dry run[/]: {plan.model_path} ({plan.spec.family}, {plan.num_layers} layers)")
    console.print(f"  method {cfg.method}, {cfg.bits}-bit, group size {cfg.group_size}, layout {cfg.layout}")
    console.print(f"  {len(plan.quantized)} linears would be packed, {len(plan.skipped)} left float")
    for name, reason in plan.skipped.items():
        console.print(f"  skip {name}: {reason}", highlight=False)
    for note in plan.notes:
        console.print(f"  note: {note}")


def _print_summary(report, cfg) -> None:
    from rich.table import Table

    plan = report.plan
    for note in plan.notes:
        console.print(f"note: {note}")
    for warning in plan.warnings:  # said when it arose, and again here, where a long run's output ends
        _warn(warning)
    if plan.skipped:
        reasons = sorted(set(plan.skipped.values()))
        console.print(f"left float ({len(plan.skipped)} linears): {'; '.join(reasons)}")
    table = Table(title=f"quantkit quantize: {cfg.method} -> {cfg.layout}", show_header=False)
    table.add_row("model", str(plan.model_path))
    table.add_row("output", str(report.out))
    table.add_row("layers quantized", f"{len(plan.quantized)} linears in {plan.num_layers} decoder layers")
    table.add_row("layers skipped", str(len(plan.skipped)))
    table.add_row("mean loss", f"{report.mean_loss:.6g}")
    table.add_row("size on disk", f"{_mib(report.output_bytes)} (original {_mib(plan.source_bytes)}, "
                                  f"{report.output_bytes / max(plan.source_bytes, 1):.2f}x)")
    table.add_row("wall time", f"{report.seconds:.1f} s")
    for label, value in _awq_rows(report.layers, cfg.awq_duo_scaling):
        table.add_row(label, value)
    console.print(table)


def _awq_rows(layers, duo_scaling: str) -> list[tuple[str, str]]:
    """AWQ's block loss before/after and the chosen scales, from each layer's stats (with duo scaling: how many
    groups took the duo formula)."""
    stats = [layer.stats for layer in layers if "loss_awq" in layer.stats]
    if not stats:
        return []
    rtn = sum(s["loss_rtn"] for s in stats) / len(stats)
    awq = sum(s["loss_awq"] for s in stats) / len(stats)
    groups = [g for s in stats for g in s["groups"].values()]
    at = sorted({s["loss_at"] for s in stats if "loss_at" in s})  # MoE layers with streamed experts: their block's input
    label = f"loss RTN -> AWQ at the {', '.join(at)}" if at else "block loss RTN -> AWQ"
    rows = [(label, f"{rtn:.4g} -> {awq:.4g} (mean over layers)")]
    if groups:
        lo = min(g["scale_min"] for g in groups)
        hi = max(g["scale_max"] for g in groups)
        ratios = [g["ratio"] for g in groups if "ratio" in g]
        mean_ratio = f", mean ratio {sum(ratios) / len(ratios):.2f}" if ratios else ""
        duo = sum(1 for g in groups if g.get("duo"))
        duo_share = f", duo formula in {duo} of {len(groups)}" if duo_scaling != "false" else ""
        rows.append(("AWQ scales", f"{len(groups)} groups, range {lo:.3g}..{hi:.3g}{mean_ratio}{duo_share}"))
    return rows


def _mib(n: int) -> str:
    return f"{n / 1024**2:.2f} MiB"
