"""One decode step through the decoder's bound path against the same step through its modules, one process.

  python -m quantkit.bench.bound_layers [--models-dir DIR] [--batches 1,8] [--rounds 15] [--steps 20]
                                        [--threads 2] [--dtype auto]

Checkpoints: the float benchmark model and its 4-bit GPTQ checkpoint (quantkit.bench.int4_engine.checkpoints; with
--models-dir made once and reused). For each and each batch size B: B requests of 128 random prompt tokens are
prefilled and decoded 16 steps, then the model runner runs one decode step's schedule `--steps` times a round with
`Decoder.bound_layers` set (the engine's path: each layer's parts fetched once) and then cleared (every layer
through nn.Module's __call__ and attribute lookups), alternating (in reverse every other round) for `--rounds`
rounds. The two give the same logits, bit for bit (checked first). Prints each path's median step time, the median
of each round's difference, and its ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from quantkit.bench.rounds import round_order


def step_ms(runner, out, steps: int) -> float:
    """Median wall time of `steps` forwards of one scheduled step, in ms."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        runner.execute(out)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def decode_step(llm, batch: int, seed: int = 0):
    """The engine after `batch` prompts' prefill and 16 decode steps, and its next (decode) step's schedule."""
    from quantkit.engine import SamplingParams

    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        eng.add_request(torch.randint(3, eng.model.shape.vocab_size, (128,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(17):
        eng.step()
    return eng.scheduler.schedule()


def compare(llm, batch: int, rounds: int, steps: int) -> tuple[list[float], list[float]]:
    """(bound, modules) step times in ms per round, after checking that the two give the same logits."""
    runner, model = llm.engine.runner, llm.engine.model
    bound = model.bound_layers
    if bound is None:
        raise SystemExit("this checkpoint's layers have no bound path (Decoder.bind refused them)")
    out = decode_step(llm, batch)
    want = runner.execute(out).clone()
    model.bound_layers = None
    same = torch.equal(runner.execute(out), want)
    model.bound_layers = bound
    if not same:
        raise SystemExit("the bound path and the modules gave different logits")
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for r in range(rounds):
            for layers, acc in round_order(((bound, times[0]), (None, times[1])), r):
                model.bound_layers = layers
                acc.append(step_ms(runner, out, steps))
    finally:
        model.bound_layers = bound
    return times


def main() -> None:
    from quantkit.bench.int4_engine import checkpoints
    from quantkit.devices import auto_cpu_dtype
    from quantkit.engine import LLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=None, help="make the checkpoints here once and reuse them")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20, help="forwards of the step timed a round (the median counts)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = auto_cpu_dtype()[0] if args.dtype == "auto" else args.dtype
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{dtype}, {args.threads} threads, {args.rounds} alternating rounds of {args.steps} forwards a path")
    with tempfile.TemporaryDirectory() as tmp:
        models = checkpoints(args.models_dir or Path(tmp))
        for name in ("float", "4-bit GPTQ"):
            for b in batches:
                llm = LLM(str(models[name]), dtype=dtype, max_model_len=1024, max_num_seqs=b, num_threads=args.threads)
                bound, modules = compare(llm, b, args.rounds, args.steps)
                saved = statistics.median(m - x for m, x in zip(modules, bound))
                ratio = statistics.median(m / x for m, x in zip(modules, bound))
                print(f"{name}, batch {b}: step {statistics.median(bound):.3f} ms bound, {statistics.median(modules):.3f} "
                      f"ms through the modules; per round {saved:.3f} ms saved ({ratio:.3f}x)", flush=True)
                del llm


if __name__ == "__main__":
    main()
