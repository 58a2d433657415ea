"""`quantkit demo`: the whole flow on a model the project trains itself, offline, in about two minutes."""

from __future__ import annotations

from pathlib import Path

import typer

from quantkit.commands.common import console, one_line_errors, staged_output

DEFAULT_WORKDIR = Path("~/.cache/quantkit/demo")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


@one_line_errors
def demo(
    workdir: Path = typer.Option(DEFAULT_WORKDIR, "--workdir", help="Where the demo model and checkpoints go."),
    train_steps: int = typer.Option(300, "--train-steps", min=1, help="Training steps for the demo model (~1 min)."),
    retrain: bool = typer.Option(False, "--retrain", help="Train the demo model again even if one is cached."),
    prompt: str = typer.Option("Once upon a time", "--prompt"),
) -> None:
    """Train a small Llama on a generated corpus, quantize it (RTN and GPTQ, 4-bit, group 128),
    and print perplexity before and after plus a sample from the INT4 checkpoint."""
    from quantkit.demo import DemoSpec

    workdir = workdir.expanduser()
    workdir.mkdir(parents=True, exist_ok=True)
    spec = DemoSpec(train_steps=train_steps)
    model_dir = _demo_model(workdir / "model", spec, retrain)
    results = _quantize_both(model_dir, workdir, spec)
    _report(model_dir, workdir, spec, results, prompt)


def _demo_model(model_dir: Path, spec, retrain: bool) -> Path:
    """Train the demo model, or reuse the one a previous run left."""
    from quantkit.demo import train_demo_model

    if retrain or not (model_dir / "model.safetensors").is_file():
        with staged_output(model_dir, force=True) as tmp:
            stats = train_demo_model(tmp, spec)
        console.print(f"trained the demo model: {stats['steps']} steps, {stats['train_tokens']} tokens, "
                      f"final train loss {stats['final_train_loss']:.3f}, {stats['seconds']:.0f} s")
    else:
        console.print(f"using the cached demo model in {model_dir} (--retrain to train again)")
    return model_dir


def _quantize_both(model_dir: Path, workdir: Path, spec) -> dict:
    """RTN and GPTQ, 4-bit, group 128, calibrated on stories the model did not train on."""
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.demo import corpus_text
    from quantkit.quant.pipeline import quantize_model

    calib = workdir / "calib.txt"
    calib.write_text(corpus_text(1000, seed=spec.seed + 1))
    results = {}
    for method in ("rtn", "gptq"):
        out = workdir / method
        cfg = QuantizeConfig(model=str(model_dir), out=out, method=method, group_size=128, force=True,
                             calib=CalibConfig(source=str(calib), nsamples=64, seqlen=spec.context))
        with staged_output(out, force=True) as tmp:
            results[method] = quantize_model(cfg, tmp)
    return results


def _report(model_dir: Path, workdir: Path, spec, results: dict, prompt: str) -> None:
    """Held-out perplexity of each model, and a greedy sample from the GPTQ checkpoint."""
    import torch
    from rich.table import Table
    from transformers import AutoTokenizer

    from quantkit.demo import corpus_text
    from quantkit.eval.perplexity import perplexity, tokenize_once
    from quantkit.model.loader import load_model

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids, bos_note = tokenize_once(tok, corpus_text(spec.heldout_stories, seed=spec.seed + 2))

    def ppl_of(path: Path) -> tuple[float, object]:
        model, _ = load_model(path)
        return perplexity(model, ids, spec.context, "held-out synthetic stories", bos_note).ppl, model

    table = Table(title="quantkit demo: held-out perplexity (synthetic stories, windows of 256 tokens)")
    for col in ("model", "perplexity", "size on disk", "quantize time"):
        table.add_column(col)
    base_ppl, _ = ppl_of(model_dir)
    table.add_row("float32", f"{base_ppl:.3f}", _mib(results["gptq"].plan.source_bytes), "")
    for method, report in results.items():
        ppl, model = ppl_of(workdir / method)
        table.add_row(f"{method} int4 g128", f"{ppl:.3f} ({(ppl / base_ppl - 1) * 100:+.2f}%)",
                      _mib(report.output_bytes), f"{report.seconds:.1f} s")
    prompt_ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():  # `model` is the last one scored: the GPTQ checkpoint
        out = model.generate(prompt_ids, max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id)
    console.print(table)
    console.print(f"[bold]GPTQ INT4 sample[/] (greedy): {tok.decode(out[0], skip_special_tokens=True)}",
                  highlight=False)
    console.print(f"checkpoints: {workdir / 'rtn'}, {workdir / 'gptq'}")


def _mib(n: int) -> str:
    return f"{n / 1024**2:.2f} MiB"
