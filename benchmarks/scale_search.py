"""The data-free scale search (`--scale-search mse`): the vectorized search against the one-candidate-at-a-time
reference (quantkit.quant.scale_search_reference), one process, alternating rounds, on real layer shapes.

  python benchmarks/scale_search.py [--models suite|NAME,...] [--big PATH] [--big-layers 2] [--rounds 5]
                                    [--threads 1] [--sym]

Per model: the decoder linears of each layer searched as `quantkit quantize --method rtn --scale-search mse` searches
them (ours: a layer's linears together; the reference: one linear at a time), every layer of each suite model, and
the first `--big-layers` layers of `--big` (default ~/.cache/quantkit/real-shapes/llama-3.2-1b: q/k/v/o
2048x2048 / 512x2048, gate/up 8192x2048, down 2048x8192). Prints each side's median seconds, the median of the
per-round ratios (reference / ours: above 1 is faster), whether the two chose the same scales and zeros (they
must: the vectorized search is the same search), and a digest of ours (sha256 of every scale and zero, in order: the
same digest before and after a change to the search means the same choice).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from pathlib import Path

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
    from quantkit.quant.scale_search import search_weights_params
    from quantkit.quant.scale_search_reference import reference_weight_params

    scheme = QuantScheme(4, group, sym)
    found = {}

    def ours() -> float:
        t, found["ours"] = timed(lambda: [search_weights_params(ws, scheme) for ws in layers])
        return t

    def reference() -> float:
        t, found["reference"] = timed(lambda: [[reference_weight_params(w, scheme) for w in ws] for ws in layers])
        return t

    times = alternate({"ours": ours, "reference": reference}, rounds)
    same = all(torch.equal(a, b) for la, lb in zip(found["ours"], found["reference"])
               for pa, pb in zip(la, lb) for a, b in zip(pa, pb))
    weights = sum(w.numel() for ws in layers for w in ws)
    print(f"| {name} | {len(layers)} | {weights / 1e6:.2f}M | g{group} | {statistics.median(times['reference']):.3f} "
          f"| {statistics.median(times['ours']):.3f} | {per_round(times['reference'], times['ours'])} | {same} "
          f"| {digest(found['ours'])} |", flush=True)


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
    print("| model | layers | weights | group | reference s | ours s | reference / ours (per round) | same choice "
          "| digest |")
    print("|---|---|---|---|---|---|---|---|---|")
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
