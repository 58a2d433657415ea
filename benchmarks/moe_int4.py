"""One MoE layer's 4-bit experts: the grouped kernel call (kernels/moe_int4.py) against the per-expert loop it
replaces, on the engine's own loaded block, in one process.

  python benchmarks/moe_int4.py [--model Q4_DIR] [--tokens 1,8,32,512] [--dtype bfloat16] [--threads 2] [--rounds 5]
                                [--iters 30]

--model: a 4-bit MoE checkpoint (e.g. `benchmarks/moe_decode.py --keep DIR --prepare-only` writes DIR/q4); without it,
a one-layer random model of Qwen3-30B-A3B's layer shape (128 experts of 768, top 8, hidden 2048; RTN g128, GPTQ
layout) is written to a temporary folder (moe_decode.write_random_models). The engine loads it in --dtype (bfloat16:
the AVX-512 BF16 kernels; float32: the AVX2 ones); the first MoE block then runs on random x [T, 2048] with its experts stacked (one grouped call) and with `grouped` unset (each
expert that got tokens: gate|up, SiLU, down, weighted add), alternating in rounds (reversed every other round). Printed
per T: the median microseconds of each path, the median of each round's ratio, and the experts the router chose.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # moe_decode.py beside this file

from moe_decode import write_random_models  # noqa: E402

from quantkit.bench.rounds import alternate, per_round  # noqa: E402


def timer(block, x: torch.Tensor, grouped, iters: int):
    from quantkit.engine.decoder import ops_for

    ops = ops_for(x)  # the elementwise ops the decoder hands the block

    def run() -> float:
        block.grouped = grouped
        with torch.no_grad():
            block(x, ops)  # warm
            start = time.perf_counter()
            for _ in range(iters):
                block(x, ops)
            return (time.perf_counter() - start) / iters * 1e6
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tokens", default="1,8,32,512")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from quantkit.engine import LLM
    from quantkit.engine.moe import MoEBlock

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "q4"
            write_random_models(Path(tmp) / "bf16", model, layers=1, vocab=1024)
        llm = LLM(str(model), dtype=args.dtype, max_model_len=256)
    block = next(m for m in llm.engine.model.modules() if isinstance(m, MoEBlock))
    grouped = block.grouped
    dtype = getattr(torch, args.dtype)
    if grouped is None or dtype not in grouped.max_m:
        sys.exit(f"the model's MoE layers do not run the grouped op in {args.dtype} here (4-bit experts; bf16 needs "
                 "AVX-512 BF16)")
    hidden = grouped.w1.shape[2]
    print(f"{args.dtype}, threads {args.threads}, {grouped.w1.shape[0]} experts, hidden {hidden}, intermediate "
          f"{grouped.intermediate}, top {block.moe.top_k}; microseconds per block call (router included)")
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(t)).to(dtype)
        with torch.no_grad():
            chosen = torch.topk(getattr(block, block.spec.router)(x).float(), block.moe.top_k).indices
        times = alternate({"grouped": timer(block, x, grouped, args.iters),
                           "loop": timer(block, x, None, args.iters)}, args.rounds)
        g, loop = (statistics.median(times[k]) for k in ("grouped", "loop"))
        speed = per_round(times["loop"], times["grouped"])
        print(f"T={t:3d}: {chosen.unique().numel():3d} experts  grouped {g:8.0f} us  loop {loop:8.0f} us  "
              f"grouped speed-up {speed}")
    block.grouped = grouped


if __name__ == "__main__":
    main()
