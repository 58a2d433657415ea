"""The working tree's int4 extension (its int4 and int8 linear kernels) against the same extension as git revision
REV built it (quantkit.bench.kernel_revision), one process, alternating rounds.

  python -m quantkit.bench.linears_against REV [--models-dir out/int4-models] [--threads 2] [--ms 1,8,64]
                                               [--rounds 15]

Linears: the 4-bit GPTQ checkpoint's (quantkit.bench.int4_engine's model: q/k/v and gate/up fused, as the engine runs
them), each called once per pass with its own weights, and its float lm_head held in int8 (the engine's default).
Each pass follows 64 MiB of other writes, so that it reads its weights from memory as a decode step does. Per M: the
median ms of a pass with each build, the median of each round's ratio (REV / this tree), and the largest difference
between the two builds' outputs (0 for a change that keeps the arithmetic).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch


def main() -> None:
    from quantkit.bench.int4_engine import checkpoints
    from quantkit.bench.kernel_revision import RevisionError, compare, extension_at
    from quantkit.engine import LLM
    from quantkit.kernels import int4_cpu
    from quantkit.kernels.int8_cpu import Int8Linear
    from quantkit.model.quant_linear import QuantLinear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the git revision whose build this tree's is timed against")
    ap.add_argument("--models-dir", type=Path, default=Path("out/int4-models"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if int4_cpu.extension() is None:
        raise SystemExit(f"the int4 kernel is not built here: {int4_cpu.unavailable()}")
    try:
        old = extension_at(args.rev, int4_cpu.EXTENSION, int4_cpu.SOURCES)
    except RevisionError as exc:
        raise SystemExit(f"{args.rev}: {exc}") from None
    torch.set_num_threads(args.threads)
    llm = LLM(str(checkpoints(args.models_dir)["4-bit GPTQ"]), dtype="bfloat16", max_model_len=1024, max_num_seqs=8,
              num_threads=args.threads)
    modules = list(llm.engine.model.modules())
    new = [m._direct for m in modules if isinstance(m, QuantLinear) and m._direct is not None]
    # the same calls through the revision's module: a kernel's entry point keeps its name across revisions
    before = [dataclasses.replace(d, op=getattr(old, d.op.__name__)) for d in new]
    heads = [m for m in modules if isinstance(m, Int8Linear)]
    print(f"{len(new)} int4 linears and {len(heads)} int8 lm_head, bf16, {args.threads} threads, {args.rounds} "
          f"alternating rounds; this tree against {args.rev}")
    print(f"| M | linears | this tree | {args.rev} | {args.rev} / this tree, per round | outputs differ by at most |")
    print("|---|---|---|---|---|---|")
    sizes = {d.packed.shape[1] for d in new} | {h.in_features for h in heads}
    with torch.inference_mode():
        for m in (int(v) for v in args.ms.split(",")):
            xs = {k: torch.randn(m, k).bfloat16() for k in sizes}

            def int4_pass(calls):
                return lambda: [d(xs[d.packed.shape[1]]) for d in calls]

            def head_pass(op):
                return lambda: [op(xs[h.in_features], h.packed, h.scales, h.wsum, h.out_features, h.group_size, True)
                                for h in heads]

            runs = {"int4": (int4_pass(new), int4_pass(before))}
            if heads:
                runs["int8 lm_head"] = (head_pass(heads[0]._op), head_pass(old.int8_linear_bf16))
            for what, (ours, theirs) in runs.items():
                c = compare(ours, theirs, args.rounds)
                print(f"| {m} | {what} | {c.ours_ms:.2f} ms | {c.theirs_ms:.2f} ms | **{c.ratio:.2f}x** | "
                      f"{c.max_diff:.2e} |", flush=True)


if __name__ == "__main__":
    main()
