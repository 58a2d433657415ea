"""quantkit against llm-compressor: perplexity ratio to float and quantization wall time, same windows.

  python -m quantkit.bench.vs_llmcompressor [--models tiny,stories] [--methods rtn,gptq,awq,awq-duo]
      [--threads 2] [--llmc-python PATH]

Models: `tiny` is the project's GQA Llama (quantkit.bench.train_tiny: hidden 256, 6 layers, 8 heads /
4 KV heads, every linear packed, group 128); `stories` is stories260K (only attention packs, group 64).
Calibration: 32 windows of 256 tokens from wikitext2/valid.txt (seed 0); perplexity: the first 20,000
tokens of wikitext2/test.txt in 256-token windows.

For each model and method, alternately: `quantkit quantize` in a child process (its time is the
pipeline's own wall_seconds, imports excluded), then llm-compressor's `oneshot` in its own venv
(tests/interop/llmcompressor_gptq.py, oneshot's wall time, imports excluded), both with the same
OMP/torch thread count. The two calibration token hashes are compared (the run stops if they
differ). Each tool's perplexity ratio is to the float model scored by the same code.
Methods: rtn = asymmetric RTN; gptq = symmetric GPTQ (damp 0.01, block 128, no act-order);
awq / awq-duo = asymmetric AWQ without / with duo scaling.
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
DEFAULT_LLMC = ROOT / ".venvs" / "llmcompressor" / "bin" / "python"  # PEERS.md: a venv of its own, git-ignored
CALIB = SHARED / "wikitext2" / "valid.txt"
PPL_TEXT = SHARED / "wikitext2" / "test.txt"
NSAMPLES, SEQLEN, PPL_TOKENS, PPL_SEQLEN = 32, 256, 20_000, 256

# method -> (quantkit quantize args, llm-compressor script args)
METHODS = {
    "rtn": (["--method", "rtn", "--no-sym", "--format", "awq"], ["--method", "rtn"]),
    "gptq": (["--method", "gptq"], ["--method", "gptq"]),
    "awq": (["--method", "awq", "--no-awq-duo-scaling"], ["--method", "awq"]),
    "awq-duo": (["--method", "awq", "--awq-duo-scaling"], ["--method", "awq", "--duo"]),
}
MODELS = {"tiny": (128, "all"), "stories": (64, "attention")}  # group size, llm-compressor targets


def model_path(name: str) -> Path:
    if name == "stories":
        return SHARED / "stories260K-hf"
    from quantkit.bench.train_tiny import ensure_model

    return ensure_model()


def ppl_ratio_ours(path: Path, float_ppl: float | None) -> tuple[float, float]:
    from quantkit.eval.perplexity import perplexity, tokenize_once
    from quantkit.model.loader import load_model, load_tokenizer

    model, _ = load_model(path)
    ids, note = tokenize_once(load_tokenizer(path), PPL_TEXT.read_text(encoding="utf-8"))
    ppl = perplexity(model.eval(), ids[:PPL_TOKENS], PPL_SEQLEN, "wikitext2/test.txt", note).ppl
    return ppl, ppl / float_ppl if float_ppl else 1.0


def run_ours(model: Path, out: Path, method: str, group: int, threads: int, float_ppl: float) -> dict:
    args = METHODS[method][0] + ["--group-size", str(group), "--calib", str(CALIB), "--nsamples", str(NSAMPLES),
                                 "--seqlen", str(SEQLEN), "--seed", "0", "--threads", str(threads)]
    run = quantize_in_child(model, out, args, threads)
    ppl, ratio = ppl_ratio_ours(out, float_ppl)
    meta = json.loads((out / "quantkit_meta.json").read_text())
    return {"wall_s": run.quantize_s, "ppl": ppl, "ratio": ratio, "hash": meta["calibration_token_sha256"]}


def run_peer(python: Path, model: Path, out: Path, method: str, group: int, targets: str, threads: int,
             skip_float: bool) -> dict:
    cmd = [str(python), str(PEER_SCRIPT), "--model", str(model), *METHODS[method][1], "--targets", targets,
           "--group-size", str(group), "--calib", str(CALIB), "--nsamples", str(NSAMPLES), "--seqlen", str(SEQLEN),
           "--seed", "0", "--ppl-text", str(PPL_TEXT), "--ppl-seqlen", str(PPL_SEQLEN),
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


def bench_model(name: str, methods: list[str], threads: int, python: Path, root: Path) -> list[dict]:
    from quantkit.model.loader import load_model, load_tokenizer
    from quantkit.eval.perplexity import perplexity, tokenize_once

    group, targets = MODELS[name]
    model = model_path(name)
    fmodel, _ = load_model(model)
    ids, note = tokenize_once(load_tokenizer(model), PPL_TEXT.read_text(encoding="utf-8"))
    float_ours = perplexity(fmodel.eval(), ids[:PPL_TOKENS], PPL_SEQLEN, "wikitext2/test.txt", note).ppl
    del fmodel
    print(f"# {name}: {model.name}, group {group}, float ppl (quantkit) {float_ours:.3f}", flush=True)
    rows, float_peer = [], None
    for method in methods:
        ours = run_ours(model, root / f"{name}-{method}-qk", method, group, threads, float_ours)
        peer = run_peer(python, model, root / f"{name}-{method}-llmc", method, group, targets, threads,
                        skip_float=float_peer is not None)
        float_peer = float_peer or peer["float_ppl"]
        row = {"model": name, "method": method, "ours": ours, "peer": {**peer, "ratio": peer["ppl"] / float_peer}}
        print(json.dumps(row), flush=True)
        if ours["hash"] is not None and ours["hash"] != peer["hash"]:  # RTN reads no calibration: no hash
            raise SystemExit(f"{name} {method}: calibration windows differ ({ours['hash'][:12]} vs {peer['hash'][:12]})")
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| model | method | quantkit ppl (x float) | llm-compressor ppl (x float) | quantkit s | llm-compressor s "
          "| time ours/theirs |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        o, p = r["ours"], r["peer"]
        print(f"| {r['model']} | {r['method']} | {o['ppl']:.3f} ({o['ratio']:.4f}x) | {p['ppl']:.3f} ({p['ratio']:.4f}x) "
              f"| {o['wall_s']:.2f} | {p['wall_s']:.2f} | {o['wall_s'] / p['wall_s']:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,stories")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llmc-python", type=Path, default=Path(os.environ.get("QUANTKIT_LLMC_PYTHON", DEFAULT_LLMC)))
    args = ap.parse_args()
    if not args.llmc_python.is_file():
        raise SystemExit(f"llm-compressor's python not found at {args.llmc_python} (--llmc-python)")
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    print(f"# threads {args.threads}, load avg {os.getloadavg()[0]:.2f} at start", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-llmc-") as tmp:
        for name in args.models.split(","):
            rows += bench_model(name, [m.strip() for m in args.methods.split(",")], args.threads, args.llmc_python,
                                Path(tmp))
    print(f"# load avg {os.getloadavg()[0]:.2f} at end")
    print_table(rows)


if __name__ == "__main__":
    main()
