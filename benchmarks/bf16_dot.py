"""quantkit's bf16 linear (Bf16DotLinear: AMX tiles where the CPU has them, AVX-512 BF16 otherwise) against oneDNN's
prepacked bf16 GEMM (PrepackedLinear), one process, alternating rounds: the kernels alone, then the engine built on each.

  python benchmarks/bf16_dot.py [--threads 2] [--ms 1,2,4,8,16,64,512,2048] [--rounds 5]
                                    [--models-dir out/int4-models] [--batches 1,8] [--engine-rounds 7]
                                    [--skip-kernels] [--skip-engine]

Kernels: the linears of one decode step of the issue's Llama (hidden 1024, intermediate 2816, 8 layers, vocab 32000:
q/k/v and gate/up fused, as the engine runs them, and the lm_head), every layer its own weights, so that each call
reads its weight from memory as in a model (305 MiB in all, ten times the L3). Per M: each side's median time over
the 33 calls, the rate at which it read the weights, and the median of each round's ratio (oneDNN / ours). Where the
AMX path is built and granted, the same modules run a third time with it switched off (the AVX-512 BF16 tiles).

Engine: the float checkpoint (`--models-dir`'s bf16, made where missing) loaded twice, once as the engine runs it
and once with the bf16 kernel switched off at load (oneDNN's prepacked linears). Decode tokens/s as
benchmarks/int4_engine.py measures it, and the prefill of 8 prompts of 128 tokens (wall time to one token).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch


@contextlib.contextmanager
def onednn_linears():
    """Within the block, engines load their float linears as oneDNN-prepacked (the bf16 kernel off)."""
    from quantkit.kernels import bf16_cpu

    saved = bf16_cpu.bf16_dot_available
    bf16_cpu.bf16_dot_available = lambda: False
    try:
        yield
    finally:
        bf16_cpu.bf16_dot_available = saved


def step_shapes() -> list[tuple[int, int]]:
    """(N, K) of one decode step's linears, in the order the engine calls them."""
    from quantkit.bench.engine_vs_vllm import SHAPE

    h, i, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_key_value_heads"]
    qkv = h + 2 * kv * h // SHAPE["num_attention_heads"]
    layer = [(qkv, h), (h, h), (2 * i, h), (h, i)]
    return layer * SHAPE["num_hidden_layers"] + [(SHAPE["vocab_size"], h)]


@contextlib.contextmanager
def amx_switched(on: bool):
    """Within the block, Bf16DotLinear runs on AMX tiles where they apply (on) or on the AVX-512 BF16 tiles only."""
    from quantkit.kernels import bf16_cpu

    ext = bf16_cpu.extension()
    if not ext.has_amx():
        yield
        return
    old = ext.dev.set_amx(on)
    try:
        yield
    finally:
        ext.dev.set_amx(old)


def kernels(ms: list[int], rounds: int) -> None:
    from quantkit.kernels import bf16_cpu
    from quantkit.kernels.bf16_cpu import Bf16DotLinear
    from quantkit.kernels.cpu_linear import PrepackedLinear

    shapes = step_shapes()
    linears = [torch.nn.Linear(k, n, bias=False).to(torch.bfloat16).requires_grad_(False) for n, k in shapes]
    ours = [Bf16DotLinear(m) for m in linears]
    sides = {"oneDNN": ([PrepackedLinear(m) for m in linears], True), "quantkit": (ours, True)}
    amx = bf16_cpu.extension().has_amx()
    if amx:  # the same modules with the AMX path off
        sides["quantkit AVX-512"] = (ours, False)
    del linears
    weight_bytes = 2 * sum(n * k for n, k in shapes)
    print(f"{len(shapes)} linears of a decode step, {weight_bytes / 2**20:.0f} MiB of bf16 weights, {rounds} rounds; "
          f"quantkit: {'AMX tiles where they apply (amx_bf16.h), ' if amx else ''}AVX-512 BF16 tiles otherwise")
    print("| M | " + " | ".join(sides) + " | oneDNN / quantkit, per round |" + (" AVX-512 / quantkit |" if amx else ""))
    print("|---|" + "---|" * (len(sides) + 1 + amx))
    with torch.inference_mode():
        for m in ms:
            xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in shapes}}
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(rounds + 1):  # the first round warms up, not counted
                for name, (mods, amx_on) in sides.items():
                    with amx_switched(amx_on):
                        t = time.perf_counter()
                        for mod, (_, k) in zip(mods, shapes):
                            mod(xs[k])
                        times[name].append(time.perf_counter() - t)
            cells = []
            for name in sides:
                t = statistics.median(times[name][1:])
                cells.append(f"{t * 1e3:.2f} ms ({weight_bytes / t / 1e9:.1f} GB/s, {m * weight_bytes / 2 / t / 1e9:.0f}"
                             " GMAC/s)")
            ratios = [statistics.median(a / b for a, b in zip(times[name][1:], times["quantkit"][1:]))
                      for name in ("oneDNN", "quantkit AVX-512") if name in times]
            print(f"| {m} | " + " | ".join(cells) + " | " + " | ".join(f"**{r:.2f}x**" for r in ratios) + " |",
                  flush=True)


def engine(models_dir: Path, batches: list[int], rounds: int, threads: int) -> None:
    from int4_engine import _wall, checkpoints, decode_tok_s
    from quantkit.engine import LLM
    from quantkit.engine.weights import WeightMemory
    from quantkit.kernels.bf16_cpu import Bf16DotLinear

    path = checkpoints(models_dir)["float"]

    def load() -> LLM:
        return LLM(str(path), dtype="bfloat16", max_model_len=1024, max_num_seqs=max(batches + [8]), num_threads=threads)

    ours = load()
    with onednn_linears():
        theirs = load()
    assert isinstance(ours.engine.model.lm_head, Bf16DotLinear)
    assert not isinstance(theirs.engine.model.lm_head, Bf16DotLinear)
    print(f"{path}: bf16, {threads} threads, {rounds} alternating rounds; quantkit "
          f"{WeightMemory.of(ours.engine.model).resident / 2**20:.1f} MiB of weights, oneDNN "
          f"{WeightMemory.of(theirs.engine.model).resident / 2**20:.1f} MiB")
    print("| run | quantkit | oneDNN | quantkit / oneDNN, per round |")
    print("|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    runs = [(f"decode, batch {b}", b, "tok/s") for b in batches] + [("prefill 8 x 128 (to one token)", 8, "ms")]
    for label, b, unit in runs:
        prompts = [torch.randint(3, 32000, (128,), generator=g).tolist() for _ in range(b)]
        for llm in (ours, theirs):
            _wall(llm, prompts, 2)  # warm-up at this batch size, not counted
        got: dict[str, list[float]] = {"quantkit": [], "oneDNN": []}
        for _ in range(rounds):
            for name, llm in (("quantkit", ours), ("oneDNN", theirs)):
                if unit == "tok/s":
                    got[name].append(decode_tok_s(llm, prompts, 48))
                else:  # fresh prompts each round: no prefix-cache hits
                    fresh = [torch.randint(3, 32000, (128,), generator=g).tolist() for _ in range(b)]
                    got[name].append(_wall(llm, fresh, 1) * 1e3)
        ratios = [a / o if unit == "tok/s" else o / a for a, o in zip(got["quantkit"], got["oneDNN"])]
        print(f"| {label} | {statistics.median(got['quantkit']):.1f} {unit} | {statistics.median(got['oneDNN']):.1f} "
              f"{unit} | **{statistics.median(ratios):.2f}x** ({', '.join(f'{r:.2f}' for r in ratios)}) |", flush=True)


def main() -> None:
    from quantkit.kernels.bf16_cpu import bf16_dot_available, unavailable

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", default="1,2,4,8,16,64,512,2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models-dir", type=Path, default=Path("out/int4-models"))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--engine-rounds", type=int, default=7)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    if not bf16_dot_available():
        raise SystemExit(f"the bf16 dot kernel does not run here: {unavailable() or 'this CPU has no AVX-512 BF16'}")
    torch.set_num_threads(args.threads)
    if not args.skip_kernels:
        kernels([int(m) for m in args.ms.split(",")], args.rounds)
    if not args.skip_engine:
        engine(args.models_dir, [int(b) for b in args.batches.split(",")], args.engine_rounds, args.threads)


if __name__ == "__main__":
    main()
