"""`quantkit generate MODEL --prompt TEXT`: greedy or sampled text from a float or quantized checkpoint."""

from __future__ import annotations

import typer

from quantkit.commands.common import one_line_errors


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)


@one_line_errors
def generate(
    model: str = typer.Argument(..., help="Checkpoint folder (float or quantized) or hub id."),
    prompt: str = typer.Option(..., "--prompt", help="The prompt text."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Generate text from MODEL (quantized checkpoints load through quantkit's QuantLinear)."""
    import torch

    from quantkit.model.loader import load_model, load_tokenizer

    lm, _ = load_model(model)
    tok = load_tokenizer(model)
    ids = tok(prompt, return_tensors="pt").input_ids
    torch.manual_seed(seed)
    with torch.no_grad():
        out = lm.generate(ids, max_new_tokens=max_tokens, do_sample=temperature > 0,
                          temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                          pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    typer.echo(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
