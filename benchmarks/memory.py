"""Quantize memory benchmark: does peak RSS stay near one decoder layer, whatever the depth?

  python benchmarks/memory.py [--layers 2,22] [--methods rtn,gptq] [--nsamples 2 --seqlen 512]
                                             [--quantize-args=--no-low-memory]  (default: --low-memory)

For each depth, a random Llama with TinyLlama-1.1B's layer shapes (bf16 on disk) is quantized by
`quantkit quantize` in a child process, and its peak RSS taken (os.wait4). A `--dry-run` on the
deepest model gives the fixed cost (interpreter, torch, transformers, reading the headers).
Printed: the peak per run; the growth of peak RSS per added decoder layer (the layer-by-layer bound
holds when it is near zero, far below one layer's size); and the peak against a budget of
fixed cost + one decoder layer in fp32 + fp32 embeddings + calibration activations (in and out).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from quantkit.bench.runs import ONE_B, QuantizeRun, make_random_llama, quantize_in_child

GIB = 1024**3


def layer_params(shape: dict) -> int:
    """Weights of one Llama decoder layer (q, k, v, o, gate, up, down and two norms)."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h


def budget_gib(fixed_gib: float, shape: dict, nsamples: int, seqlen: int) -> float:
    """Fixed cost + one fp32 layer + fp32 embeddings + activations in and out (fp32)."""
    embed = shape["vocab_size"] * shape["hidden_size"]
    activations = 2 * nsamples * seqlen * shape["hidden_size"]
    return fixed_gib + 4 * (layer_params(shape) + embed + activations) / GIB


def growth_per_layer_gib(runs: dict[int, QuantizeRun]) -> float:
    lo, hi = min(runs), max(runs)
    return (runs[hi].peak_rss_gib - runs[lo].peak_rss_gib) / (hi - lo)


def measure(root: Path, depths: list[int], methods: list[str], common: list[str], threads: int,
            shape: dict = ONE_B) -> tuple[float, dict[str, dict[int, QuantizeRun]]]:
    """(dry-run peak GiB on the deepest model, {method: {depth: run}})."""
    runs: dict[str, dict[int, QuantizeRun]] = {m: {} for m in methods}
    fixed = 0.0
    for depth in sorted(depths):
        model = make_random_llama(root / f"llama-{depth}", depth, shape)
        if depth == max(depths):
            fixed = quantize_in_child(model, root / "dry", ["--dry-run"], threads).peak_rss_gib
        for method in methods:
            runs[method][depth] = quantize_in_child(model, root / f"{method}-{depth}", ["--method", method, *common],
                                                    threads)
            print(f"{method} x {depth} layers: {runs[method][depth]}", flush=True)
    return fixed, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,22", help="decoder layer counts to compare")
    ap.add_argument("--methods", default="rtn,gptq")
    ap.add_argument("--calib", default=str(Path(__file__).resolve().parents[2].parent / "shared" / "data"
                                           / "wikitext2" / "test.txt"))
    ap.add_argument("--nsamples", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantize-args", default="--low-memory",
                    help="more `quantkit quantize` options (default --low-memory: quantize's own default turns it on "
                         "from 1 GiB of fp32 weights, which the 2-layer model is under and the 22-layer one over)")
    args = ap.parse_args()
    depths = [int(x) for x in args.layers.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    common = ["--group-size", "128", "--calib", args.calib, "--nsamples", str(args.nsamples),
              "--seqlen", str(args.seqlen), "--seed", "0", *args.quantize_args.split()]
    print(f"# TinyLlama-1.1B shapes, depths {depths}, calib {args.nsamples}x{args.seqlen}, "
          f"torch threads {args.threads}, load avg {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-mem-") as tmp:
        fixed, runs = measure(Path(tmp), depths, methods, common, args.threads)
    layer_gib = layer_params(ONE_B) / GIB
    budget = budget_gib(fixed, ONE_B, args.nsamples, args.seqlen)
    print(f"\nfixed cost (--dry-run peak): {fixed:.2f} GiB; one decoder layer: {2 * layer_gib:.3f} GiB bf16, "
          f"{4 * layer_gib:.3f} GiB fp32; budget (fixed + fp32 layer + fp32 embeddings + activations): {budget:.2f} GiB")
    print("| method | layers | quantize s | peak RSS GiB | peak / budget |")
    print("|---|---|---|---|---|")
    for method, by_depth in runs.items():
        for depth, r in sorted(by_depth.items()):
            print(f"| {method} | {depth} | {r.quantize_s:.1f} | {r.peak_rss_gib:.2f} | {r.peak_rss_gib / budget:.2f} |")
    for method, by_depth in runs.items() if len(depths) > 1 else ():
        g = growth_per_layer_gib(by_depth)
        print(f"{method}: peak RSS grows {1024 * g:.1f} MiB per added layer "
              f"({g / (2 * layer_gib):.1%} of one bf16 layer)")


if __name__ == "__main__":
    main()
