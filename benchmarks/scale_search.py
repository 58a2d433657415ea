"""The data-free scale search (`--scale-search mse`): the vectorized search against the one-candidate-at-a-time
reference (quantkit.quant.scale_search_reference), its candidates' errors from torch and from the C++ kernel
(quantkit.kernels.group_error), one process, alternating rounds, on real layer shapes.

  python benchmarks/scale_search.py [--models suite|NAME,...] [--big PATH] [--big-layers 2] [--rounds 5]
                                    [--threads 1] [--sym]

Per model: the decoder linears of each layer searched as `quantkit quantize --method rtn --scale-search mse` searches
them (ours: a layer's linears together; the reference: one linear at a time), every layer of each suite model, and
the first `--big-layers` layers of `--big` (default ~/.cache/quantkit/real-shapes/llama-3.2-1b: q/k/v/o
2048x2048 / 512x2048, gate/up 8192x2048, down 2048x8192). Prints each variant's median seconds and the medians of
the per-round ratios (above 1: the second is faster); whether the torch errors chose the reference's scales and
zeros (they must: it is the same search), and the kernel's share of groups that chose as the reference (its sums
are ordered otherwise: near ties may go the other way); a digest of each (sha256 of every scale and zero, in order:
the same digest before and after a change to the search means the same choice).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from quantkit.bench.rounds import alternate, per_round

BIG = Path.home() / ".cache" / "quantkit" / "real-shapes" / "llama-3.2-1b"


def layer_weights(path: Path, layers: int | None, attention_only: bool = False) -> list[list[torch.Tensor]]:
    """Each decoder layer's linear weights [N, K] fp32, read from the checkpoint (the first `layers` layers; only
    self_attn's with `attention_only`)."""
    from quantkit.model.checkpoint import ShardReader

    reader = ShardReader(path)
    by_layer: dict[int, list[torch.Tensor]] = {}
    for key in reader.keys():
        parts = key.split(".")
        if key.endswith("proj.weight") and "layers" in parts and (not attention_only or "self_attn" in parts):
            i = int(parts[parts.index("layers") + 1])
            if layers is None or i < layers:
                by_layer.setdefault(i, []).append(reader.get(key).float())
    return [by_layer[i] for i in sorted(by_layer)]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench(name: str, layers: list[list[torch.Tensor]], group: int, sym: bool, rounds: int) -> None:
    from quantkit.format.primitives import QuantScheme
    from quantkit.kernels import group_error
    from quantkit.quant.scale_search import search_weights_params
    from quantkit.quant.scale_search_reference import reference_weight_params

    scheme = QuantScheme(4, group, sym)
    found = {}

    def ours(errors: str):
        def run() -> float:
            with contextlib.ExitStack() as stack:
                if errors == "torch":  # the candidates' errors from the pure-torch reference, as without the kernel
                    stack.enter_context(mock.patch.object(group_error, "extension", lambda: None))
                t, found[errors] = timed(lambda: [search_weights_params(ws, scheme) for ws in layers])
            return t
        return run

    def reference() -> float:
        t, found["reference"] = timed(lambda: [[reference_weight_params(w, scheme) for w in ws] for ws in layers])
        return t

    variants = {"reference": reference, "torch": ours("torch")}
    if group_error.unavailable() is None:
        variants["kernel"] = ours("kernel")
    times = alternate(variants, rounds)
    weights = sum(w.numel() for ws in layers for w in ws)
    kernel = ("-", "-", "-", "-")
    if "kernel" in times:
        kernel = (f"{statistics.median(times['kernel']):.3f}", per_round(times["torch"], times["kernel"]),
                  f"{same_share(found['kernel'], found['reference']):.4%}", digest(found["kernel"]))
    print(f"| {name} | {len(layers)} | {weights / 1e6:.2f}M | g{group} | {statistics.median(times['reference']):.3f} "
          f"| {statistics.median(times['torch']):.3f} | {per_round(times['reference'], times['torch'])} "
          f"| {same_share(found['torch'], found['reference']) == 1} | {digest(found['torch'])} | "
          + " | ".join(kernel) + " |", flush=True)


def same_share(found, reference) -> float:
    """The share of groups whose scale and zero are the reference's."""
    same = total = 0
    for la, lb in zip(found, reference):
        for (sa, za), (sb, zb) in zip(la, lb):
            same += int(((sa == sb) & (za == zb)).sum())
            total += sa.numel()
    return same / total


def digest(found: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> str:
    """The first 16 hex digits of the sha256 of every layer's weights' scales and zeros, in order."""
    h = hashlib.sha256()
    for layer in found:
        for scales, zeros in layer:
            h.update(scales.numpy().tobytes())
            h.update(zeros.numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    from quantkit.bench import suite

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="suite", help="suite, or comma-separated names of quantkit.bench.suite")
    ap.add_argument("--big", type=Path, default=BIG, help="a larger checkpoint, its first --big-layers layers")
    ap.add_argument("--big-layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sym", action="store_true", help="symmetric groups (default: asymmetric, as rtn-mse)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = suite.SUITE if args.models == "suite" else [suite.lookup(n) for n in args.models.split(",")]
    print("| model | layers | weights | group | reference s | torch s | reference / torch (per round) | same choice "
          "| digest | kernel s | torch / kernel (per round) | groups as the reference | kernel's digest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        path = suite.cached_path(model)
        if path is None:
            print(f"| {model.name} | not cached: python -m quantkit.bench.suite --models {model.name} |")
            continue
        layers = layer_weights(path, None, attention_only=model.targets == "attention")  # stories260K: attention packs
        bench(model.name, layers, model.group, args.sym, args.rounds)
    if args.big.is_dir():
        bench(args.big.name, layer_weights(args.big, args.big_layers), 128, args.sym, args.rounds)


if __name__ == "__main__":
    main()
