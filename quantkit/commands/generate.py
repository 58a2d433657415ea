"""`quantkit generate MODEL`: text from a float or quantized checkpoint through the paged-KV engine.

One prompt (`--prompt`) prints its completion; many (`--prompts-file`, one per line or JSONL
with "prompt") run batched with a progress bar, and `--output out.jsonl` gets one line per
prompt: prompt, text, token_ids, finish_reason (and error, for a prompt the engine refused; note,
when generation stopped at the context limit before --max-tokens). One prompt the engine refuses
is an error (exit 2); in a file, the others still run and the exit status is 1.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import typer

from quantkit.commands.common import console, engine_switch, one_line_errors
from quantkit.commands.flags import argument, command, option
from quantkit.errors import QuantkitError

_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2, "g": 1024**3, "gib": 1024**3,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3}


def register(app: typer.Typer) -> None:
    app.command("generate")(command(GenerateFlags, generate))


def parse_size(text: str) -> int:
    """'512MiB', '1GiB', '2G' or a number of bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise QuantkitError(f"--kv-cache-memory {text!r}: expected a size such as 512MiB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def read_prompts(path: Path) -> list[str]:
    """One prompt per non-blank line, or JSONL objects with a "prompt" field."""
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise QuantkitError(f"{path}: cannot read prompts ({exc})") from exc
    if not lines:
        raise QuantkitError(f"{path}: no prompts in the file")
    if path.suffix != ".jsonl" and not all(ln.lstrip().startswith("{") for ln in lines):
        return lines
    prompts = []
    for i, ln in enumerate(lines, 1):
        try:
            row = json.loads(ln)
        except json.JSONDecodeError as exc:
            raise QuantkitError(f"{path}:{i}: not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise QuantkitError(f"{path}:{i}: expected an object with a string \"prompt\"")
        prompts.append(row["prompt"])
    return prompts


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write to a temp file beside `path`, then rename: no half-written output on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def parse_json_option(text: str | None, flag: str) -> dict | None:
    """A flag's JSON object (None when not given); a one-line error otherwise."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QuantkitError(f"{flag}: not JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(value, dict):
        raise QuantkitError(f"{flag}: expected a JSON object")
    return value


def structured_outputs(json_schema: Path | None, regex: str | None):
    """--json-schema / --regex as the engine's StructuredOutputsParams (None: free text)."""
    from quantkit.engine import StructuredOutputsParams

    if json_schema is not None and regex is not None:
        raise QuantkitError("give at most one of --json-schema and --regex")
    if json_schema is not None:
        try:
            schema = json.loads(json_schema.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise QuantkitError(f"{json_schema}: not a readable JSON schema ({exc})") from None
        return StructuredOutputsParams(json=schema)
    return None if regex is None else StructuredOutputsParams(regex=regex)


def output_row(out, note: str | None = None) -> dict:
    c = out.outputs[0]
    row = {"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
    if out.error:
        row["error"] = out.error
    if note:
        row["note"] = note
    return row


@dataclass(frozen=True)
class GenerateFlags:
    """`quantkit generate`'s command line as typed (vLLM's flag names where they exist)."""

    model: str = argument(..., help="Checkpoint folder (float, GPTQ or AWQ) or hub id.")
    prompt: str | None = option(None, "--prompt", help="One prompt.")
    prompts_file: Path | None = option(None, "--prompts-file", help="One prompt per line, or JSONL with \"prompt\".")
    output: Path | None = option(None, "--output", help="Write one JSON line per prompt here.")
    max_tokens: int = option(64, "--max-tokens", min=1)
    temperature: float = option(0.0, "--temperature", help="0 = greedy.")
    top_p: float = option(1.0, "--top-p")
    top_k: int = option(0, "--top-k", help="0 = off.")
    seed: int | None = option(None, "--seed", help="Per-request seed for reproducible sampling.")
    max_num_seqs: int = option(64, "--max-num-seqs")
    max_model_len: int | None = option(None, "--max-model-len")
    kv_cache_memory: str | None = option(None, "--kv-cache-memory", help="KV pool size on CPU, e.g. 512MiB.")
    num_kv_blocks: int | None = option(None, "--num-kv-blocks")
    swap_space: float = option(0.0, "--swap-space", help="GiB of CPU swap for preempted requests.")
    prefix_caching: bool = option(True, "--prefix-caching/--no-prefix-caching")
    dtype: str = option("auto", "--dtype", help=("auto (float16 on GPU; on CPU bfloat16 where it computes natively, "
                                                "else float32), float32, bfloat16 or float16 (GPU)."))
    threads: int | None = option(None, "--threads", help="CPU threads for torch (small models: 1 is fastest).")
    cpu_int8_activations: bool = engine_switch("cpu_int8_activations")
    cpu_int8_lm_head: bool | None = engine_switch("cpu_int8_lm_head")
    cpu_int8_prefill: bool | None = engine_switch("cpu_int8_prefill")
    cpu_huge_pages: bool = engine_switch("cpu_huge_pages")
    json_schema: Path | None = option(None, "--json-schema", help="A JSON schema file: every output is JSON that "
                                      "matches it (a token mask at each step).")
    regex: str | None = option(None, "--regex", help="Every output matches this regular expression.")
    speculative_config: str | None = option(
        None, "--speculative-config", help="vLLM's JSON, n-gram prompt lookup: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (greedy output unchanged, fewer steps where the "
        "output repeats its prompt).")


def make_llm(f: GenerateFlags):
    """The engine the flags ask for."""
    from quantkit.engine import LLM

    return LLM(f.model, max_num_seqs=f.max_num_seqs, max_model_len=f.max_model_len, num_kv_blocks=f.num_kv_blocks,
               kv_cache_memory=None if f.kv_cache_memory is None else parse_size(f.kv_cache_memory),
               swap_space=f.swap_space, enable_prefix_caching=f.prefix_caching, dtype=f.dtype,
               num_threads=f.threads, cpu_int8_activations=f.cpu_int8_activations,
               cpu_int8_lm_head=f.cpu_int8_lm_head, cpu_int8_prefill=f.cpu_int8_prefill,
               cpu_huge_pages=f.cpu_huge_pages,
               speculative_config=parse_json_option(f.speculative_config, "--speculative-config"))


def print_rows(rows: list[dict], one_prompt: bool, output: Path | None) -> None:
    """Each row's warning or note on the console; the rows to `output` (JSONL), or the one completion's text, or
    every row as a JSON line on stdout."""
    for i, row in enumerate(rows, 1):
        if "error" in row or "note" in row:
            what = f"[yellow]warning:[/] {row['error']}" if "error" in row else f"note: {row['note']}"
            console.print(what if one_prompt else f"prompt {i}: {what}", highlight=False)
    if output is not None:
        write_jsonl(output, rows)
        console.print(f"wrote {len(rows)} completions to {output}", highlight=False)
    elif one_prompt:
        typer.echo(rows[0]["text"])
    else:
        for row in rows:
            typer.echo(json.dumps(row, ensure_ascii=False))


@one_line_errors
def generate(ctx: typer.Context, flags: GenerateFlags) -> None:
    """Generate text for one prompt or a file of prompts, batched on the paged-KV engine."""
    f = flags
    if (f.prompt is None) == (f.prompts_file is None):
        raise QuantkitError("give exactly one of --prompt or --prompts-file")
    prompts = [f.prompt] if f.prompt is not None else read_prompts(f.prompts_file)
    from quantkit.engine import SamplingParams
    from quantkit.engine.llm import context_limit_note
    from quantkit.engine.weights import WeightMemory

    params = SamplingParams(temperature=f.temperature, top_p=f.top_p, top_k=f.top_k, seed=f.seed,
                            max_tokens=f.max_tokens, structured_outputs=structured_outputs(f.json_schema, f.regex))
    llm = make_llm(f)
    console.print(WeightMemory.of(llm.engine.model).describe(), highlight=False, soft_wrap=True)
    if params.structured_outputs is not None:  # a schema that does not compile: one line before any generation
        llm.engine.grammars.compile(params.structured_outputs)
    console.print(llm.engine.kv_plan.describe(), highlight=False)
    outs = _run_with_progress(llm, prompts, params)
    if f.prompt is not None and outs[0].error:
        raise QuantkitError(f"--prompt: {outs[0].error}")
    rows = [output_row(o, context_limit_note(o, params, llm.engine.max_model_len)) for o in outs]
    print_rows(rows, f.prompt is not None, f.output)
    failed = sum("error" in row for row in rows)
    if failed:
        console.print(f"[bold red]{failed} of {len(rows)} prompts failed[/] (their records carry the error)",
                      highlight=False)
        raise typer.Exit(1)


def _run_with_progress(llm, prompts: list[str], params):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=len(prompts) == 1) as bar:
        task = bar.add_task("generate", total=len(prompts))
        return llm.generate(prompts, params, on_output=lambda _: bar.advance(task))
