"""What the int4 kernel's newer tiles buy (int4_bf16_avx512.h), each against the tile it replaced, one process,
alternating rounds: at 1-2 rows of x, 8 columns a step (lane_tile, unpack_eight; switch `set_lane_tiles`) against a
column pair a step; from 8 rows, two blocks a tile (wide_tile; `set_wide_tiles`) against one. With `--switch
eight-columns`, instead, the tiles of 3 rows and more unpacking 8 columns a step (nibbles, pair_of; switch
`set_eight_columns`) against a pair a step. With `--switch amx`, the AMX tiles (int4_amx.h, from 2 rows; the int8
head's too) against the AVX-512 ones (`set_amx`), at any number of rows. The kernel over a decode step's int4 linears, then the engine's decode.
Then the large-M path (int4_cpu._dense_tiles, from 160 rows): tiles dequantized into the bf16 kernel's layout
(int4_dequantize_pairs) against fp32 tiles cast to bf16 for F.linear, with the kernel beside them (where the two
paths cross: int4_cpu.DENSE_FROM_M_BF16_KERNEL).

  python -m quantkit.bench.int4_tiles [--models-dir out/int4-models] [--threads 2] [--ms 1,2,8,16]
                                      [--batches 1,2,8] [--dense-ms 64,128,160,512] [--rounds 9] [--max-tokens 64]
                                      [--switch tiles|eight-columns|amx]

Kernel: the 4-bit GPTQ checkpoint's quantized linears (q/k/v and gate/up fused, as the engine runs them), each called
once per pass with its own weights; the rate at which a pass reads the packed codes and scales. Engine: decode
tokens/s as quantkit.bench.int4_engine measures it, the same engine with the switch set each way. With `--switch
tiles`, rows of x or batch sizes of 3-7 run neither tile and are refused; with `eight-columns`, 1-2 rows are. Each
row: the medians, and the median of each round's ratio (new / old).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch


SETTINGS = {"new": True, "old": False}


def print_row(label: str, unit: str, got: dict[str, list[float]], faster_is_higher: bool) -> None:
    a, b = got["new"], got["old"]
    ratios = [x / y if faster_is_higher else y / x for x, y in zip(a, b)]
    print(f"| {label} | {statistics.median(a):.2f} {unit} | {statistics.median(b):.2f} {unit} | "
          f"**{statistics.median(ratios):.2f}x** |", flush=True)


def kernels(direct: list, ms: list[int], rounds: int, tile) -> None:
    """The linears' direct kernel calls, each M with its tile switched each way."""
    nbytes = sum(d.packed.numel() + d.scale_zero.numel() * d.scale_zero.element_size() for d in direct)
    with torch.inference_mode():
        for m in ms:
            xs = {d.packed.shape[1]: torch.randn(m, d.packed.shape[1]).bfloat16() for d in direct}
            got: dict[str, list[float]] = {name: [] for name in SETTINGS}
            for _ in range(rounds):
                for name, on in SETTINGS.items():
                    tile(m)[1](on)
                    t = time.perf_counter()
                    for d in direct:
                        d(xs[d.packed.shape[1]])
                    got[name].append((time.perf_counter() - t) * 1e3)
            print_row(f"kernel, M = {m}, {tile(m)[0]} ({nbytes / statistics.median(got['new']) / 1e6:.1f} against "
                      f"{nbytes / statistics.median(got['old']) / 1e6:.1f} GB/s)", "ms", got, False)


def engine(llm, batches: list[int], rounds: int, max_tokens: int, tile) -> None:
    """The engine's decode at each batch size with its tile switched each way."""
    from quantkit.bench.int4_engine import _wall, decode_tok_s

    g = torch.Generator().manual_seed(0)
    for b in batches:
        prompts = [torch.randint(3, 32000, (128,), generator=g).tolist() for _ in range(b)]
        _wall(llm, prompts, 2)  # warm-up at this batch size, not counted
        got: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for _ in range(rounds):
            for name, on in SETTINGS.items():
                tile(b)[1](on)
                got[name].append(decode_tok_s(llm, prompts, max_tokens))
        print_row(f"engine decode, batch {b}", "tok/s", got, True)


def main() -> None:
    from quantkit.bench.int4_engine import checkpoints
    from quantkit.engine import LLM
    from quantkit.kernels.int4_cpu import extension
    from quantkit.model.quant_linear import QuantLinear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=Path("out/int4-models"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", default="1,2,8,16")
    ap.add_argument("--batches", default="1,2,8")
    ap.add_argument("--dense-ms", default="64,128,160,512")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--switch", choices=("tiles", "eight-columns", "amx"), default="tiles")
    args = ap.parse_args()
    ext = extension()
    if ext is None or not hasattr(ext, "set_lane_tiles"):
        raise SystemExit("the int4 kernel's bf16 tiles are not built here (no AVX-512 BF16)")
    ms, batches = [int(v) for v in args.ms.split(",")], [int(v) for v in args.batches.split(",")]
    if args.switch == "tiles" and any(2 < v < 8 for v in ms + batches):
        ap.error("rows and batch sizes of 3-7 run neither of the two tiles: choose 1, 2 or 8 and more")
    if args.switch == "eight-columns" and any(v <= 2 for v in ms + batches):
        ap.error("1-2 rows run lane_tile, which the eight-columns switch does not reach: choose 3 rows and more")

    if args.switch == "amx" and not ext.has_amx():
        raise SystemExit("no AMX tiles here (not built for this CPU, or Linux did not grant them)")

    def tile(rows: int):
        """(what the new tile is, the switch that turns it on and off) at this many rows of x"""
        if args.switch == "eight-columns":
            return "8 columns a step (nibbles, pair_of)", ext.set_eight_columns
        if args.switch == "amx":
            return "AMX tiles", ext.set_amx
        return ("8 columns a step", ext.set_lane_tiles) if rows <= 2 else ("two blocks a tile", ext.set_wide_tiles)

    torch.set_num_threads(args.threads)
    llm = LLM(str(checkpoints(args.models_dir)["4-bit GPTQ"]), dtype="bfloat16", max_model_len=1024,
              max_num_seqs=8, num_threads=args.threads)
    direct = [m._direct for m in llm.engine.model.modules() if isinstance(m, QuantLinear) and m._direct is not None]
    print(f"{len(direct)} int4 linears, {sum(d.packed.numel() for d in direct) / 2**20:.1f} MiB of codes, bf16, "
          f"{args.threads} threads, {args.rounds} alternating rounds")
    print("| run | new tile | old tile | new / old, median per round |")
    print("|---|---|---|---|")
    try:
        kernels(direct, ms, args.rounds, tile)
        engine(llm, batches, args.rounds, args.max_tokens, tile)
        ext.set_amx(True)  # the large-M paths as the engine runs them
        dense(llm, [int(v) for v in args.dense_ms.split(",")], args.rounds)
    finally:
        ext.set_lane_tiles(True)
        ext.set_wide_tiles(True)
        ext.set_eight_columns(True)
        ext.set_amx(True)


def dense(llm, ms: list[int], rounds: int) -> None:
    """The large-M path both ways, and the kernel, over the checkpoint's int4 linears (GMAC/s, medians)."""
    from quantkit.bench.bf16_dot import onednn_linears
    from quantkit.kernels.int4_cpu import int4_blocked_linear
    from quantkit.model.quant_linear import QuantLinear

    ws = [m._cpu for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    macs = sum(w.out_features * w.packed.shape[1] for w in ws)
    print("| M | kernel | dense tiles, bf16 kernel | dense tiles, F.linear | bf16 kernel / F.linear, per round |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for m in ms:
            xs = {w.packed.shape[1]: torch.randn(m, w.packed.shape[1]).bfloat16() for w in ws}
            got: dict[str, list[float]] = {"kernel": [], "pairs": [], "F.linear": []}
            for _ in range(rounds):
                for name in got:
                    with onednn_linears() if name == "F.linear" else contextlib.nullcontext():
                        t = time.perf_counter()
                        for w in ws:
                            int4_blocked_linear(xs[w.packed.shape[1]], w, None, dense_from_m=m + 1 if name == "kernel" else 0)
                        got[name].append(time.perf_counter() - t)
            rate = {name: m * macs / statistics.median(v) / 1e9 for name, v in got.items()}
            ratio = statistics.median(b / a for a, b in zip(got["pairs"], got["F.linear"]))
            print(f"| {m} | {rate['kernel']:.0f} GMAC/s | {rate['pairs']:.0f} | {rate['F.linear']:.0f} | **{ratio:.2f}x** |",
                  flush=True)


if __name__ == "__main__":
    main()
