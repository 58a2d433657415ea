"""quantkit against llm-compressor: perplexity ratio to float and quantization wall time, same windows.

  python -m quantkit.bench.vs_llmcompressor [--models tiny,stories|suite|NAME,...] [--methods rtn,gptq,awq,awq-duo,awq-both]
      [--threads 2] [--tools ours,peer] [--seeds 0] [--llmc-python PATH]
  python -m quantkit.bench.vs_llmcompressor --table RUN1.log RUN2.log ...   # one table from split runs

Models: `suite` is the accuracy suite (quantkit.bench.suite: six small Llamas of different shapes trained
in fp32, and stories260K-hf; each at its own group size), or any of its models by name; `tiny` is the project's GQA Llama (quantkit.bench.train_tiny: hidden 256, 6 layers, 8 heads /
4 KV heads, every linear packed, group 128); `stories` is stories260K (only attention packs, group 64).
Calibration: 32 windows of 256 tokens from wikitext2/valid.txt (seed 0; `--seeds 0,1,2` repeats every
run on the windows each seed draws, and the table ends with the mean over the seeds: a difference
between the tools smaller than the spread over seeds is noise); perplexity: the first 20,000 tokens of
wikitext2/test.txt in 256-token windows.

For each model and method, alternately: `quantkit quantize` in a child process (its time is the
pipeline's own wall_seconds, imports excluded), then llm-compressor's `oneshot` in its own venv
(tests/interop/llmcompressor_gptq.py, oneshot's wall time, imports excluded), both with the same
OMP/torch thread count. The two calibration token hashes are compared (the run stops if they
differ). Each tool's perplexity ratio is to the float model scored by the same code. The last
column is the whole `quantkit quantize` child process (interpreter start, imports, checkpoint
writing included), for the time a user waits.
`--tools ours` or `--tools peer` runs one tool (to split a long run under the machine's heavy-job
lock); `--table` joins the ROW lines such runs print into one table, checking the hashes again.
Methods: rtn = asymmetric RTN; gptq = symmetric GPTQ (damp 0.01, block 128, no act-order);
awq / awq-duo / awq-both = asymmetric AWQ without / with duo scaling / with both formulas searched per group;
rtn-mse, rtn-imatrix = asymmetric RTN with searched group scales (--scale-search mse: data-free; imatrix), gptq-imatrix
= GPTQ with imatrix-searched groups (quantkit only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from quantkit.bench.runs import quantize_in_child

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
PEER_SCRIPT = ROOT / "tests" / "interop" / "llmcompressor_gptq.py"
DEFAULT_LLMC = ROOT.parent / ".venvs" / "llmcompressor" / "bin" / "python"  # PEERS.md: ../.venvs/llmcompressor, a venv of its own
CALIB = SHARED / "wikitext2" / "valid.txt"
PPL_TEXT = SHARED / "wikitext2" / "test.txt"
NSAMPLES, SEQLEN, PPL_TOKENS, PPL_SEQLEN = 32, 256, 20_000, 256

# method -> (quantkit quantize args, llm-compressor script args)
METHODS = {
    "rtn": (["--method", "rtn", "--no-sym", "--format", "awq"], ["--method", "rtn"]),
    "gptq": (["--method", "gptq"], ["--method", "gptq"]),
    "awq": (["--method", "awq", "--awq-duo-scaling", "false"], ["--method", "awq"]),
    "awq-duo": (["--method", "awq", "--awq-duo-scaling", "true"], ["--method", "awq", "--duo", "true"]),
    "awq-both": (["--method", "awq", "--awq-duo-scaling", "both"], ["--method", "awq", "--duo", "both"]),
    # quantkit's searched group scales (no llm-compressor counterpart run here: --tools peer skips them)
    "rtn-mse": (["--method", "rtn", "--no-sym", "--format", "awq", "--scale-search", "mse"], None),
    "rtn-imatrix": (["--method", "rtn", "--no-sym", "--format", "awq", "--scale-search", "imatrix"], None),
    "gptq-imatrix": (["--method", "gptq", "--scale-search", "imatrix"], None),
}
TINY = (128, "all")  # the GQA test model's group size and llm-compressor targets


def model_entry(name: str, tiny_steps: int | None = None) -> tuple[Path, int, str]:
    """The model's folder, group size and llm-compressor targets. `tiny` is trained (and cached) first
    when absent, with `tiny_steps` training steps (default: train_tiny's); `stories` is stories260K-hf;
    any other name is a model of the accuracy suite (quantkit.bench.suite), trained first when absent."""
    from quantkit.bench import suite

    if name != "tiny":
        model = suite.lookup("stories260k" if name == "stories" else name)
        return suite.ensure(model), model.group, model.targets
    from dataclasses import replace

    from quantkit.bench.train_tiny import default_spec, ensure_model

    spec = default_spec()
    return ensure_model(spec=spec if tiny_steps is None else replace(spec, steps=tiny_steps)), *TINY


def model_names(models: str) -> list[str]:
    """--models: comma-separated names; `suite` stands for every model of the accuracy suite."""
    from quantkit.bench.suite import SUITE

    names = []
    for name in (n.strip() for n in models.split(",")):
        names += [m.name for m in SUITE] if name == "suite" else [name]
    return names


def ppl_ratio_ours(path: Path, float_ppl: float | None) -> tuple[float, float]:
    from quantkit.eval.perplexity import perplexity, tokenize_once
    from quantkit.model.loader import load_model, load_tokenizer

    model, _ = load_model(path)
    ids, note = tokenize_once(load_tokenizer(path), PPL_TEXT.read_text(encoding="utf-8"))
    ppl = perplexity(model.eval(), ids[:PPL_TOKENS], PPL_SEQLEN, "wikitext2/test.txt", note).ppl
    return ppl, ppl / float_ppl if float_ppl else 1.0


def run_ours(model: Path, out: Path, method: str, group: int, threads: int, float_ppl: float, seed: int = 0) -> dict:
    args = METHODS[method][0] + ["--group-size", str(group), "--calib", str(CALIB), "--nsamples", str(NSAMPLES),
                                 "--seqlen", str(SEQLEN), "--seed", str(seed), "--threads", str(threads)]
    run = quantize_in_child(model, out, args, threads)
    ppl, ratio = ppl_ratio_ours(out, float_ppl)
    meta = json.loads((out / "quantkit_meta.json").read_text())
    return {"wall_s": run.quantize_s, "process_s": round(run.process_s, 2), "ppl": ppl, "ratio": ratio,
            "hash": meta["calibration_token_sha256"]}


def run_peer(python: Path, model: Path, out: Path, method: str, group: int, targets: str, threads: int,
             skip_float: bool, seed: int = 0) -> dict:
    cmd = [str(python), str(PEER_SCRIPT), "--model", str(model), *METHODS[method][1], "--targets", targets,
           "--group-size", str(group), "--calib", str(CALIB), "--nsamples", str(NSAMPLES), "--seqlen", str(SEQLEN),
           "--seed", str(seed), "--ppl-text", str(PPL_TEXT), "--ppl-seqlen", str(PPL_SEQLEN),
           "--ppl-tokens", str(PPL_TOKENS), "--threads", str(threads), "--out", str(out)]
    if skip_float:
        cmd.append("--skip-float-ppl")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"llm-compressor run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    return {"wall_s": r["oneshot_wall_s"], "ppl": r["quant_ppl"], "float_ppl": r["float_ppl"],
            "hash": r["calib_token_sha256"]}


def bench_model(name: str, methods: list[str], threads: int, python: Path, root: Path, tools: set[str],
                tiny_steps: int | None = None, seeds: tuple[int, ...] = (0,)) -> list[dict]:
    model, group, targets = model_entry(name, tiny_steps)
    float_ours = ppl_ratio_ours(model, None)[0] if "ours" in tools else None
    print(f"# {name}: {model.name}, group {group}, float ppl (quantkit) {float_ours}", flush=True)
    rows, float_peer = [], None
    for method, seed in ((m, s) for m in methods for s in seeds):
        row = {"model": name, "method": method, "seed": seed, "threads": threads,
               "load_avg": round(os.getloadavg()[0], 2)}
        if "ours" in tools:
            row["ours"] = run_ours(model, root / f"{name}-{method}-{seed}-qk", method, group, threads, float_ours, seed)
        if "peer" in tools and METHODS[method][1] is not None:
            peer = run_peer(python, model, root / f"{name}-{method}-{seed}-llmc", method, group, targets, threads,
                            skip_float=float_peer is not None, seed=seed)
            float_peer = float_peer or peer["float_ppl"]
            row["peer"] = {**peer, "float_ppl": float_peer, "ratio": peer["ppl"] / float_peer}
        print("ROW " + json.dumps(row), flush=True)
        hashes = {row[t]["hash"] for t in ("ours", "peer") if t in row and row[t]["hash"] is not None}
        if len(hashes) > 1:  # RTN reads no calibration in quantkit: no hash
            raise SystemExit(f"{name} {method}: calibration windows differ ({sorted(hashes)})")
        rows.append(row)
    return rows


def merge_rows(rows: list[dict]) -> list[dict]:
    """Rows of separate runs (one tool each) joined by (model, method, seed); the calibration hashes checked."""
    merged: dict[tuple, dict] = {}
    for r in rows:
        seed = r.get("seed", 0)
        m = merged.setdefault((r["model"], r["method"], seed), {"model": r["model"], "method": r["method"], "seed": seed})
        for tool in ("ours", "peer"):
            if tool in r:
                m[tool] = {**r[tool], "load_avg": r.get("load_avg")}
    for m in merged.values():
        hashes = {m[t]["hash"] for t in ("ours", "peer") if t in m and m[t]["hash"] is not None}
        if len(hashes) > 1:
            raise SystemExit(f"{m['model']} {m['method']}: calibration windows differ ({sorted(hashes)})")
    return list(merged.values())


def _cell(side: dict | None, fmt: str) -> str:
    return "-" if side is None else fmt.format(**side)


def print_table(rows: list[dict]) -> None:
    """One line per run; with more than one seed, the seed in the method column and a mean line per
    (model, method) after the runs."""
    seeds = {r.get("seed", 0) for r in rows}
    print("| model | method | quantkit ppl (x float) | llm-compressor ppl (x float) | quantkit s | llm-compressor s "
          "| time ours/theirs | quantkit CLI process s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        method = r["method"] if len(seeds) == 1 else f"{r['method']} (seed {r.get('seed', 0)})"
        o, p = r.get("ours"), r.get("peer")
        ratio = f"{o['wall_s'] / p['wall_s']:.2f}x" if o and p else "-"
        print(f"| {r['model']} | {method} | {_cell(o, '{ppl:.3f} ({ratio:.4f}x)')} "
              f"| {_cell(p, '{ppl:.3f} ({ratio:.4f}x)')} | {_cell(o, '{wall_s:.2f}')} | {_cell(p, '{wall_s:.2f}')} "
              f"| {ratio} | {_cell(o, '{process_s}') if o and 'process_s' in o else '-'} |")
    if len(seeds) > 1:
        for line in mean_lines(rows):
            print(line)


def mean_lines(rows: list[dict]) -> list[str]:
    """Table lines with each (model, method)'s mean over its seeds: ratio to float (min-max in
    brackets) and seconds, per tool."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["method"]), []).append(r)
    lines = []
    for (model, method), runs in groups.items():
        cells, walls = [], {}
        for tool in ("ours", "peer"):
            sides = [r[tool] for r in runs if tool in r]
            if not sides:
                cells.append("-")
                continue
            ratios = [x["ratio"] for x in sides]
            walls[tool] = sum(x["wall_s"] for x in sides) / len(sides)
            cells.append(f"{sum(ratios) / len(ratios):.4f}x ({min(ratios):.4f}-{max(ratios):.4f})")
        time_ratio = f"{walls['ours'] / walls['peer']:.2f}x" if len(walls) == 2 else "-"
        lines.append(f"| {model} | **{method}, mean of {len(runs)} seeds** | {cells[0]} | {cells[1]} "
                     f"| {walls.get('ours', 0):.2f} | {walls.get('peer', 0):.2f} | {time_ratio} | - |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,stories",
                    help="tiny, stories, names of quantkit.bench.suite's models, or suite (all of them)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tools", default="ours,peer", help="ours, peer, or ours,peer (both): one tool per run splits a long run")
    ap.add_argument("--table", type=Path, nargs="*", default=None,
                    help="print the table from the ROW lines of earlier runs' output files, run nothing")
    ap.add_argument("--seeds", default="0", help="calibration seeds, comma-separated: every run once per seed")
    ap.add_argument("--tiny-steps", type=int, default=None,
                    help="the GQA test model trained for this many steps (default: train_tiny's)")
    ap.add_argument("--llmc-python", type=Path, default=Path(os.environ.get("QUANTKIT_LLMC_PYTHON", DEFAULT_LLMC)))
    args = ap.parse_args()
    if args.table is not None:
        lines = [ln for f in args.table for ln in f.read_text().splitlines() if ln.startswith("ROW ")]
        print_table(merge_rows([json.loads(ln[len("ROW "):]) for ln in lines]))
        return
    tools = set(args.tools.split(","))
    if not tools or not tools <= {"ours", "peer"}:
        raise SystemExit(f"--tools takes ours, peer or ours,peer (got {args.tools!r})")
    if "peer" in tools and not args.llmc_python.is_file():
        raise SystemExit(f"llm-compressor's python not found at {args.llmc_python} (--llmc-python)")
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    print(f"# threads {args.threads}, load avg {os.getloadavg()[0]:.2f} at start", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-llmc-") as tmp:
        for name in model_names(args.models):
            rows += bench_model(name, [m.strip() for m in args.methods.split(",")], args.threads, args.llmc_python,
                                Path(tmp), tools, args.tiny_steps, tuple(int(x) for x in args.seeds.split(",")))
    print(f"# load avg {os.getloadavg()[0]:.2f} at end")
    print_table(merge_rows(rows))


if __name__ == "__main__":
    main()
