"""The int8 lm_head (kernels/csrc/int8_amx.h on AMX, int8_bf16_avx512.h by `vpdpbusd`) against a bf16 head on oneDNN,
per M, at a real vocabulary: Llama 3's 128256 rows of the 1B shape's 2048 columns (`--shape 8b`: 4096), weights in
transparent huge pages as the engine holds them, bf16 activations, one process, the variants in a rotated order each
round (the host's bandwidth drifts within a minute). The table gives each variant's median ms and the medians of the
per-round ratios to the int8 head as the engine runs it; the AMX tiles' outputs are checked equal to `vpdpbusd`'s.

    python benchmarks/int8_head.py --ms 1,8,16,24,32,48,64 --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from quantkit.bench.rounds import add_round_options, alternate, median_row, rotated_order, table_head

HIDDEN = {"1b": 2048, "8b": 4096}


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    from quantkit.engine.huge_pages import thp_unavailable, zeros_in_huge_pages

    if thp_unavailable() is not None:
        return t
    (h,) = zeros_in_huge_pages(tuple(t.shape), t.dtype, 1)
    return h.copy_(t)


def heads(ext, vocab: int, hidden: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> the head on x [M, hidden]: the int8 head as dispatched (AMX from the extension's row threshold where
    granted), the same with AMX off (`vpdpbusd` only; only where AMX is granted), bf16 on oneDNN (prepacked)."""
    from quantkit.kernels.cpu_linear import PrepackedLinear
    from quantkit.kernels.int8_cpu import pack_int8

    w = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * 0.02
    q = pack_int8(w, 128)
    packed, scales, wsum = (in_huge_pages(t) for t in (q.packed, q.scales, q.wsum))

    def int8(x: torch.Tensor) -> torch.Tensor:
        return ext.int8_linear_bf16(x, packed, scales, wsum, vocab, 128, True)

    def vnni(x: torch.Tensor) -> torch.Tensor:
        ext.dev.set_amx(False)
        try:
            return int8(x)
        finally:
            ext.dev.set_amx(True)

    linear = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(w)
    dense = PrepackedLinear(linear)  # oneDNN's own packed copy (not in huge pages: it allocates it)
    out = {"int8": int8}
    if ext.has_amx():
        out["int8 VNNI"] = vnni
    out["bf16 oneDNN"] = dense
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,8,16,24,32,48,64")
    ap.add_argument("--shape", choices=sorted(HIDDEN), default="1b")
    ap.add_argument("--vocab", type=int, default=128256, help="rows of the head (Llama 3's vocabulary)")
    ap.add_argument("--reps", type=int, default=3, help="calls a round; the best counts")
    add_round_options(ap, rounds=5, threads=2)
    args = ap.parse_args()
    from quantkit.kernels.cpu_int import best_ms
    from quantkit.kernels.int4_cpu import extension
    from quantkit.kernels.int8_cpu import int8_kernel_available

    torch.set_num_threads(args.threads)
    ext = extension()
    if ext is None or not int8_kernel_available(torch.bfloat16):
        raise SystemExit("needs the int8 head for bf16 activations (AVX-512 VNNI and BF16; quantkit env)")
    hidden = HIDDEN[args.shape]
    runs = heads(ext, args.vocab, hidden)
    print(f"lm_head {args.vocab} x {hidden}, group 128, {args.threads} threads, median of {args.rounds} rounds (best of "
          f"{args.reps} calls each)")
    names = list(runs)
    print(table_head(["M", *(f"{n} ms" for n in names), *(f"{n} / int8" for n in names[1:])]))
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, hidden).bfloat16()
        times = alternate({n: (lambda f=f: best_ms(lambda: f(x), args.reps)) for n, f in runs.items()}, args.rounds,
                          order=rotated_order)
        if "int8 VNNI" in runs and not torch.equal(runs["int8"](x), runs["int8 VNNI"](x)):
            raise SystemExit(f"the AMX tiles and vpdpbusd disagree at M = {m}")  # they sum the same int32 products
        print(median_row(m, times, [(n, "int8") for n in names[1:]], digits=2), flush=True)


if __name__ == "__main__":
    main()
