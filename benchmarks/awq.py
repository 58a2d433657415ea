"""AWQ benchmark: perplexity, wall time and peak memory of AWQ beside RTN and GPTQ.

  python benchmarks/awq.py stories   [--nsamples 128 --seqlen 512]
  python benchmarks/awq.py random1b  [--layers 2 --nsamples 4 --seqlen 512]

Each method is one `quantkit quantize` subprocess (same model, calibration and group size), so
its peak RSS is its own (os.wait4); the quantize time is the `wall_seconds` the pipeline records
in quantkit_meta.json (start-up and imports excluded). `stories` then scores every checkpoint's
perplexity in this process with quantkit.eval.perplexity (non-overlapping windows of
--ppl-seqlen, the GPTQ/AWQ protocol). `random1b` is a randomly initialised Llama with
TinyLlama-1.1B's layer shapes (hidden 2048, intermediate 5632, 32 heads / 4 kv heads, vocab
32000) cut to --layers decoder layers: its perplexity means nothing, so only time and memory.
Ratios are printed against RTN (asym), or against the first method when RTN (asym) is not run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from quantkit.bench.runs import make_random_llama, quantize_in_child

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
METHODS = {
    "rtn (sym)": ["--method", "rtn"],
    "rtn (asym)": ["--method", "rtn", "--no-sym"],
    "gptq": ["--method", "gptq"],
    "awq": ["--method", "awq"],
    "awq (duo)": ["--method", "awq", "--awq-duo-scaling", "true"],
    "awq (both)": ["--method", "awq", "--awq-duo-scaling", "both"],
}


def ppl_of(path: Path, text: str, seqlen: int) -> float:
    from quantkit.eval.perplexity import perplexity, tokenize_once
    from quantkit.model.loader import load_model, load_tokenizer

    model, _ = load_model(path)
    ids, note = tokenize_once(load_tokenizer(path), text)
    return perplexity(model.eval(), ids, seqlen, "bench", note).ppl


def print_table(rows: dict[str, dict], with_ppl: bool) -> None:
    ref = "rtn (asym)" if "rtn (asym)" in rows else next(iter(rows))
    base = rows[ref]
    head = f"| method | quantize s | vs {ref} | peak RSS GiB |" + (" wikitext2 ppl |" if with_ppl else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, r in rows.items():
        line = (f"| {name} | {r['quantize_s']:.1f} | {r['quantize_s'] / base['quantize_s']:.1f}x | "
                f"{r['peak_rss_gib']:.2f} |")
        if with_ppl:
            line += f" {r['ppl']:.3f} |"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=("stories", "random1b"))
    ap.add_argument("--group-size", type=int, default=None, help="default: 64 for stories, 128 for random1b")
    ap.add_argument("--calib", default=str(SHARED / "wikitext2" / "test.txt"))
    ap.add_argument("--nsamples", type=int, default=None, help="default: 128 for stories, 4 for random1b")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--ppl-text", default=str(SHARED / "wikitext2" / "test.txt"))
    ap.add_argument("--ppl-seqlen", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2, help="random1b: decoder layers kept")
    ap.add_argument("--methods", default="rtn (sym),rtn (asym),gptq,awq,awq (duo)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads here and in each quantize (OMP_NUM_THREADS)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    stories = args.model == "stories"
    group = args.group_size or (64 if stories else 128)
    nsamples = args.nsamples or (128 if stories else 4)
    common = ["--group-size", str(group), "--calib", args.calib, "--nsamples", str(nsamples),
              "--seqlen", str(args.seqlen), "--seed", "0"]
    print(f"# {args.model}: group {group}, calib {args.calib} {nsamples}x{args.seqlen}, "
          f"torch threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-awq-") as tmp:
        root = Path(tmp)
        model = SHARED / "stories260K-hf" if stories else make_random_llama(root / "random1b", args.layers)
        rows = {}
        for name in [m.strip() for m in args.methods.split(",")]:
            out = root / name.replace(" ", "").replace("(", "-").replace(")", "")
            rows[name] = asdict(quantize_in_child(model, out, METHODS[name] + common, args.threads))
            if stories:
                rows[name]["ppl"] = ppl_of(out, Path(args.ppl_text).read_text(), args.ppl_seqlen)
            print(f"{name}: {rows[name]}", flush=True)
        if stories:
            print(f"float ppl: {ppl_of(model, Path(args.ppl_text).read_text(), args.ppl_seqlen):.3f}")
        print_table(rows, stories)


if __name__ == "__main__":
    main()
