"""quantkit against llm-compressor and GPTQModel: perplexity ratio and fidelity to float, quantization time.

  python -m quantkit.bench.vs_llmcompressor [--models tiny,stories|suite|NAME,...] [--methods rtn,gptq,awq,awq-duo,awq-both]
      [--threads 2] [--tools ours,peer,gptqmodel] [--seeds 0] [--llmc-python PATH] [--gptqmodel-python PATH]
      [--nsamples 32] [--seqlen 256]
  python -m quantkit.bench.vs_llmcompressor --models llama-3.1-8b:2 --methods gptq,awq --nsamples 16 --seqlen 512
  python -m quantkit.bench.vs_llmcompressor --table RUN1.log RUN2.log ...   # one table from split runs

Models: `suite` is the accuracy suite (quantkit.bench.suite: six small Llamas of different shapes trained
in fp32, and stories260K-hf; each at its own group size), or any of its models by name; `tiny` is the project's GQA Llama (quantkit.bench.train_tiny: hidden 256, 6 layers, 8 heads /
4 KV heads, every linear packed, group 128); `stories` is stories260K (only attention packs, group 64);
`SHAPE:N` is a real shape of quantkit.bench.real_shapes cut to N decoder layers (`llama-3.1-8b:2`; built and cached
first when absent; every linear, group 128): random weights, so no perplexity is scored (its columns read "-"), and
the rows are times and peak RSS, the quantization cost at a real size.
Calibration: 32 windows of 256 tokens (--nsamples, --seqlen) from wikitext2/valid.txt (seed 0; `--seeds 0,1,2` repeats every
run on the windows each seed draws, and the table ends with the mean over the seeds: a difference
between the tools smaller than the spread over seeds is noise); perplexity: the first 20,000 tokens of
wikitext2/test.txt in 256-token windows.

For each model and method, alternately: `quantkit quantize` in a child process (its time is the
pipeline's own wall_seconds, imports excluded), then llm-compressor's `oneshot` in its own venv
(tests/interop/llmcompressor_gptq.py, oneshot's wall time, imports excluded), then GPTQModel's `quantize` in its
own venv (tests/interop/gptqmodel_gptq.py, its wall time, imports excluded; its checkpoint is scored here by
quantkit's perplexity code), all with the same OMP/torch thread count. Fidelity: every tool's checkpoint is loaded
here and scored by the same code (quantkit.eval.fidelity) against the float model's log-probs, computed once per
model, on the perplexity windows: the mean KL(float || quant) per predicted token (the table shows it x1e-3, nats)
and the top-1 agreement (the share of positions where both argmaxes match). The calibration token hashes are compared
(the run stops if they differ). Each tool's perplexity ratio is to the float model scored by the same code. Then the
whole `quantkit quantize` child process (interpreter start, imports, checkpoint writing included), for the time a
user waits; last, each tool's peak RSS (VmHWM of its process: quantkit's child, the peer's worker, which loads the
whole model as its users do).
`--tools ours`, `--tools peer` (llm-compressor) or `--tools gptqmodel` runs one tool (to split a long run under the
machine's heavy-job lock); `--table` joins the ROW lines such runs print into one table, checking the hashes again.
Each peer's venv is checked first (its worker's --version): a missing or broken one stops the run with one line.
Methods: quantkit.bench.suite_methods names them, with each tool's arguments. The default --methods are those
quantkit runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from quantkit.bench.runs import quantize_in_child
from quantkit.bench.suite_methods import METHODS

if TYPE_CHECKING:
    from quantkit.eval.fidelity import FloatReference

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
DEFAULT_LLMC = ROOT.parent / ".venvs" / "llmcompressor" / "bin" / "python"  # PEERS.md: ../.venvs/llmcompressor, a venv of its own
DEFAULT_GPTQMODEL = ROOT.parent / "venvs" / "gptqmodel" / "bin" / "python"  # docs/accuracy.md: a venv of its own
CALIB = SHARED / "wikitext2" / "valid.txt"
PPL_TEXT = SHARED / "wikitext2" / "test.txt"
NSAMPLES, SEQLEN, PPL_TOKENS, PPL_SEQLEN = 32, 256, 20_000, 256
FP32_PASSES = ("--compute-dtype", "float32")  # the calibration passes of a scored model, on every CPU
REAL_SHAPE_GROUP = 128  # group size for the real shapes (SHAPE:N): the checkpoints' default
GiB = 1024**3


class Windows(NamedTuple):
    """The calibration every tool reads: `nsamples` windows of `seqlen` tokens of CALIB."""

    nsamples: int = NSAMPLES
    seqlen: int = SEQLEN

    def args(self) -> list[str]:
        return ["--calib", str(CALIB), "--nsamples", str(self.nsamples), "--seqlen", str(self.seqlen)]


@dataclass(frozen=True)
class Peer:
    """A peer tool: a worker script run by the peer's own venv's python, printing a RESULT line."""

    label: str  # the table's name for it
    script: Path
    option: str  # the option that names its python
    install: str  # where its install steps are written
    extra: tuple[str, ...] = ()  # arguments its worker takes on every run


PEERS = {
    # llm-compressor's worker also scores its checkpoint and the float model, with the same text and windows
    "peer": Peer("llm-compressor", ROOT / "tests" / "interop" / "llmcompressor_gptq.py", "--llmc-python",
                 "../shared/PEERS.md", ("--ppl-text", str(PPL_TEXT), "--ppl-seqlen", str(PPL_SEQLEN),
                                        "--ppl-tokens", str(PPL_TOKENS))),
    # GPTQModel's worker only quantizes: run_gptqmodel scores its checkpoint here
    "gptqmodel": Peer("GPTQModel", ROOT / "tests" / "interop" / "gptqmodel_gptq.py", "--gptqmodel-python",
                      "docs/accuracy.md"),
}
TOOLS = {"ours": "quantkit", **{key: peer.label for key, peer in PEERS.items()}}  # --tools -> the table's name
PEER_KEYS = tuple(PEERS)  # the table's peer columns, in this order
TINY = (128, "all")  # the GQA test model's group size and llm-compressor targets


def real_shape(name: str):
    """`SHAPE` or `SHAPE:N`, a shape of quantkit.bench.real_shapes (cut to N decoder layers): its RealShape; None for
    any other name."""
    from quantkit.bench.real_shapes import SHAPES, with_layers

    shape, _, layers = name.partition(":")
    if shape not in SHAPES:
        return None
    if layers and not layers.isdigit():
        raise SystemExit(f"--models {name}: the layer count after ':' is a whole number (got {layers!r})")
    return with_layers(SHAPES[shape], int(layers) if layers else None)


def model_entry(name: str, tiny_steps: int | None = None) -> tuple[Path, int, str]:
    """The model's folder, group size and llm-compressor targets. `tiny` is trained (and cached) first
    when absent, with `tiny_steps` training steps (default: train_tiny's); `stories` is stories260K-hf;
    `SHAPE:N` is a real shape cut to N layers, built first when absent; any other name is a model of the
    accuracy suite (quantkit.bench.suite), trained first when absent."""
    from quantkit.bench import suite

    shape = real_shape(name)
    if shape is not None:
        from quantkit.bench.real_shapes import build, default_root

        return build(shape, default_root() / shape.name), REAL_SHAPE_GROUP, "all"
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


def _model_and_ids(path: Path) -> tuple[torch.nn.Module, torch.Tensor, str]:
    """The checkpoint loaded by quantkit, and the perplexity text's first PPL_TOKENS ids with their BOS note."""
    from quantkit.eval.perplexity import tokenize_once
    from quantkit.model.loader import load_model, load_tokenizer

    model, _ = load_model(path)
    ids, note = tokenize_once(load_tokenizer(path), PPL_TEXT.read_text(encoding="utf-8"))
    return model.eval(), ids[:PPL_TOKENS], note


def ppl_ratio_ours(path: Path, float_ppl: float | None) -> tuple[float, float]:
    from quantkit.eval.perplexity import perplexity

    model, ids, note = _model_and_ids(path)
    ppl = perplexity(model, ids, PPL_SEQLEN, "wikitext2/test.txt", note).ppl
    return ppl, ppl / float_ppl if float_ppl else 1.0


def float_reference(path: Path) -> FloatReference:
    """The float model's log-probs on the perplexity windows (quantkit.eval.fidelity), for every tool's scoring."""
    from quantkit.eval.fidelity import FloatReference

    model, ids, _ = _model_and_ids(path)
    return FloatReference(model, ids, PPL_SEQLEN)


def score_checkpoint(path: Path, ref: FloatReference | None) -> dict:
    """A checkpoint (any tool's) scored by quantkit against the float reference: perplexity, its ratio to the
    float model's, mean KL(float || quant) per token and top-1 agreement, on the same windows; without a reference
    (a real shape's random weights), nothing is scored."""
    from quantkit.eval.fidelity import score

    if ref is None:
        return {"ppl": None, "ratio": None}
    fid = score(_model_and_ids(path)[0], ref)
    return {"ppl": fid.ppl, "ratio": fid.ppl / ref.ppl, "kl": fid.kl, "top1": fid.top1}


def run_ours(model: Path, out: Path, method: str, group: int, threads: int, ref: FloatReference | None, seed: int = 0,
             windows: Windows = Windows()) -> dict:
    """`quantkit quantize` in a child; its checkpoint scored against `ref` (unless None). A scored model calibrates
    in fp32, as the peers do on the suite's fp32 models, so that its checkpoint does not depend on whether this CPU
    computes bf16 (auto would take it there); a real shape (timed only) in the CLI's auto dtype."""
    args = METHODS[method].ours + ["--group-size", str(group), *windows.args(), "--seed", str(seed),
                                   "--threads", str(threads), *(FP32_PASSES if ref is not None else ())]
    run = quantize_in_child(model, out, args, threads)
    meta = json.loads((out / "quantkit_meta.json").read_text())
    return {"wall_s": run.quantize_s, "process_s": round(run.process_s, 2), **score_checkpoint(out, ref),
            "hash": meta["calibration_token_sha256"], "peak_rss_gib": round(run.peak_rss_gib, 2),
            "layer_s": [layer["seconds"] for layer in meta["layers"]]}


def worker_args(tool: str, method: str, model: Path, out: Path, group: int, targets: str, threads: int,
                seed: int, windows: Windows = Windows()) -> list[str]:
    """The arguments of `tool`'s worker for one method on one model: the method's, the peer's own, then the
    model, its group size and targets, and the calibration windows."""
    return [*getattr(METHODS[method], tool), *PEERS[tool].extra, "--model", str(model), "--targets", targets,
            "--group-size", str(group), *windows.args(), "--seed", str(seed), "--threads", str(threads),
            "--out", str(out)]


def run_worker(python: Path, tool: str, args: list[str], threads: int, cwd: Path) -> dict:
    """The peer's worker script, run by its own venv's python with `threads` OMP threads in `cwd` (a scratch
    folder: what a peer writes to its working folder stays out of the repository); its last RESULT line."""
    peer = PEERS[tool]
    cmd = [str(python), str(peer.script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{peer.label} run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def check_peer(python: Path, tool: str) -> str:
    """The peer's version, from its worker's --version in its venv; a one-line SystemExit when that venv is
    missing or cannot import the peer."""
    peer = PEERS[tool]
    hint = f"({peer.option}; install steps: {peer.install})"
    if not python.is_file():
        raise SystemExit(f"{peer.label}'s python not found at {python} {hint}")
    try:
        proc = subprocess.run([str(python), str(peer.script), "--version"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SystemExit(f"{peer.label}'s python at {python} does not start: {exc} {hint}") from None
    out, err = proc.stdout.strip().splitlines(), proc.stderr.strip().splitlines()
    if proc.returncode != 0 or not out:
        raise SystemExit(f"{peer.label} is not usable with {python}: {err[-1] if err else f'exit {proc.returncode}'} {hint}")
    return out[-1]


def run_peer(python: Path, model: Path, out: Path, method: str, group: int, targets: str, threads: int,
             skip_float: bool, ref: FloatReference | None, seed: int = 0, windows: Windows = Windows()) -> dict:
    """llm-compressor quantizes and scores its perplexity in its venv (the float model's too, unless `skip_float`);
    its checkpoint (compressed-tensors) is also scored here against `ref`, for the fidelity figures (and `ppl_qk`,
    quantkit's perplexity of it, a cross-check). Without `ref` (a real shape's random weights) nothing is scored."""
    args = worker_args("peer", method, model, out, group, targets, threads, seed, windows)
    flags = (["--skip-float-ppl"] if skip_float else []) if ref is not None else ["--no-ppl"]
    r = run_worker(python, "peer", args + flags, threads, out.parent)
    row = {"wall_s": r["oneshot_wall_s"], "ppl": r["quant_ppl"], "float_ppl": r["float_ppl"],
           "hash": r["calib_token_sha256"], "peak_rss_gib": round(r["peak_rss_bytes"] / GiB, 2)}
    if ref is not None:
        ours = score_checkpoint(out, ref)
        row.update(kl=ours["kl"], top1=ours["top1"], ppl_qk=ours["ppl"])
    return row


def run_gptqmodel(python: Path, model: Path, out: Path, method: str, group: int, targets: str, threads: int,
                  ref: FloatReference | None, seed: int = 0) -> dict:
    """GPTQModel quantizes in its venv; its checkpoint (GPTQ v1) is scored here by quantkit's perplexity code."""
    r = run_worker(python, "gptqmodel", worker_args("gptqmodel", method, model, out, group, targets, threads, seed),
                   threads, out.parent)
    return {"wall_s": r["quantize_wall_s"], **score_checkpoint(out, ref), "float_ppl": ref and ref.ppl,
            "hash": r["calib_token_sha256"], "version": r["gptqmodel"]}


def check_hashes(row: dict) -> None:
    """Every tool that read calibration read the same windows (RTN reads none in quantkit: no hash)."""
    hashes = {row[t]["hash"] for t in TOOLS if t in row and row[t]["hash"] is not None}
    if len(hashes) > 1:
        raise SystemExit(f"{row['model']} {row['method']}: calibration windows differ ({sorted(hashes)})")


def bench_model(name: str, methods: list[str], threads: int, pythons: dict[str, Path], root: Path, tools: set[str],
                tiny_steps: int | None = None, seeds: tuple[int, ...] = (0,), windows: Windows = Windows()) -> list[dict]:
    """Each method and seed on one model, by each of `tools` that runs that method; `pythons`: each peer's python.
    A real shape (random weights) is not scored: its rows are times and peak RSS."""
    model, group, targets = model_entry(name, tiny_steps)
    scored = real_shape(name) is None
    ref = float_reference(model) if scored else None  # every tool's checkpoint is scored against it (KL, top-1)
    print(f"# {name}: {model.name}, group {group}, float ppl (quantkit) {ref and ref.ppl}", flush=True)
    rows, float_peer = [], None
    for method, seed in ((m, s) for m in methods for s in seeds):
        row = {"model": name, "method": method, "seed": seed, "threads": threads,
               "load_avg": round(os.getloadavg()[0], 2)}
        spec, out = METHODS[method], root / f"{name}-{method}-{seed}"
        if "ours" in tools and spec.ours is not None:
            row["ours"] = run_ours(model, out.with_name(out.name + "-qk"), method, group, threads, ref, seed, windows)
            shutil.rmtree(out.with_name(out.name + "-qk"), ignore_errors=True)  # a real shape's is gigabytes
        if "peer" in tools and spec.peer is not None:
            peer = run_peer(pythons["peer"], model, out.with_name(out.name + "-llmc"), method, group, targets, threads,
                            skip_float=float_peer is not None, ref=ref, seed=seed, windows=windows)
            shutil.rmtree(out.with_name(out.name + "-llmc"), ignore_errors=True)
            float_peer = float_peer or peer["float_ppl"]
            row["peer"] = {**peer, "float_ppl": float_peer, "ratio": peer["ppl"] / float_peer if scored else None}
        if "gptqmodel" in tools and spec.gptqmodel is not None:
            row["gptqmodel"] = run_gptqmodel(pythons["gptqmodel"], model, out.with_name(out.name + "-gptqmodel"),
                                             method, group, targets, threads, ref, seed)
        print("ROW " + json.dumps(row), flush=True)
        check_hashes(row)
        rows.append(row)
    return rows


def parse_tools(text: str) -> set[str]:
    """--tools: comma-separated keys of TOOLS."""
    tools = {t.strip() for t in text.split(",") if t.strip()}
    if not tools or not tools <= set(TOOLS):
        raise SystemExit(f"--tools takes a comma-separated subset of {', '.join(TOOLS)} (got {text!r})")
    return tools


def parse_methods(text: str) -> list[str]:
    """--methods: comma-separated keys of METHODS."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SystemExit(f"--methods: unknown {', '.join(unknown) or 'none given'}; one of {', '.join(METHODS)}")
    return methods


def main() -> None:
    from quantkit.bench.llmc_table import merge_rows, print_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,stories",
                    help="tiny, stories, names of quantkit.bench.suite's models, or suite (all of them)")
    ap.add_argument("--methods", default=",".join(m for m, spec in METHODS.items() if spec.ours is not None))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tools", default="ours,peer",
                    help="ours (quantkit), peer (llm-compressor), gptqmodel (GPTQModel), comma-separated: one tool per "
                         "run splits a long run")
    ap.add_argument("--table", type=Path, nargs="*", default=None,
                    help="print the table from the ROW lines of earlier runs' output files, run nothing")
    ap.add_argument("--seeds", default="0", help="calibration seeds, comma-separated: every run once per seed")
    ap.add_argument("--nsamples", type=int, default=NSAMPLES, help="calibration windows, every tool")
    ap.add_argument("--seqlen", type=int, default=SEQLEN, help="tokens per calibration window, every tool")
    ap.add_argument("--tiny-steps", type=int, default=None,
                    help="the GQA test model trained for this many steps (default: train_tiny's)")
    ap.add_argument("--llmc-python", type=Path, default=Path(os.environ.get("QUANTKIT_LLMC_PYTHON", DEFAULT_LLMC)))
    ap.add_argument("--gptqmodel-python", type=Path,
                    default=Path(os.environ.get("QUANTKIT_GPTQMODEL_PYTHON", DEFAULT_GPTQMODEL)))
    args = ap.parse_args()
    if args.table is not None:
        lines = [ln for f in args.table for ln in f.read_text().splitlines() if ln.startswith("ROW ")]
        print_table(merge_rows([json.loads(ln[len("ROW "):]) for ln in lines]))
        return
    tools, methods = parse_tools(args.tools), parse_methods(args.methods)
    pythons = {"peer": args.llmc_python, "gptqmodel": args.gptqmodel_python}
    for tool in sorted(tools & set(PEERS)):
        print(f"# {PEERS[tool].label}: {check_peer(pythons[tool], tool)} ({pythons[tool]})", flush=True)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    print(f"# threads {args.threads}, load avg {os.getloadavg()[0]:.2f} at start", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-llmc-") as tmp:
        for name in model_names(args.models):
            rows += bench_model(name, methods, args.threads, pythons, Path(tmp), tools, args.tiny_steps,
                                tuple(int(x) for x in args.seeds.split(",")), Windows(args.nsamples, args.seqlen))
    print(f"# load avg {os.getloadavg()[0]:.2f} at end")
    print_table(merge_rows(rows))


if __name__ == "__main__":
    main()
