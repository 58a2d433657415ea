"""Where an engine step's time goes, on the workloads of the vLLM comparison (engine_vs_vllm.py).

  python -m quantkit.bench.engine_profile [--threads 2] [--workloads a,b,c] [--dtype auto]

Each part of the step is wrapped (in this process only) by a wall-clock accumulator: the linears
(every float linear's forward), attention (the cache write, the reads of the paged cache and the
softmax), norms (RMSNorm, fused residual add included), rotary (cos/sin tables and their
application), the rest of the forward (embedding, SiLU-and-mul, residual adds, per-layer Python),
the runner's per-step inputs (token ids, positions, attention metadata), sampling and post-processing
(sampler, stop checks, detokenizer), and the scheduler with the rest of the step. Shares are of
the summed step time; the accumulators cost well under a microsecond per call.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

PARTS = ("linears", "attention", "norms", "rotary", "rest of forward", "runner inputs",
         "sampling + postprocess", "scheduler + rest of step")


class Clock:
    """Wall time accumulated per label; nested labels are subtracted from their parents later."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)

    def wrap(self, owner, attr: str, label: str):
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t

        setattr(owner, attr, timed)
        return original


@contextlib.contextmanager
def instrumented(clock: Clock):
    """Wrap the engine's parts in `clock` for the duration of the block."""
    from quantkit.engine import decoder, llm_engine, model_runner
    from quantkit.kernels import cpu_linear

    targets = [(llm_engine.LLMEngine, "step", "step"), (model_runner.ModelRunner, "execute", "execute"),
               (decoder.Decoder, "forward", "forward"), (cpu_linear.PrepackedLinear, "forward", "linears"),
               (torch.nn.Linear, "forward", "linears"), (decoder, "paged_attention", "attention"),
               (decoder.RMSNorm, "forward", "norms"), (decoder, "apply_rope", "rotary"),
               (decoder, "cos_sin", "rotary"), (llm_engine.LLMEngine, "_postprocess", "sampling + postprocess")]
    for name in ("add_rms_norm", "rms_norm"):  # fused entry points, where the decoder has them
        if hasattr(decoder, name):
            targets.append((decoder, name, "norms"))
    originals = [(owner, attr, clock.wrap(owner, attr, label)) for owner, attr, label in targets]
    try:
        yield
    finally:
        for owner, attr, original in reversed(originals):
            setattr(owner, attr, original)


def breakdown(clock: Clock) -> dict[str, float]:
    t = clock.total
    inside = sum(t[k] for k in ("linears", "attention", "norms", "rotary"))
    return {"linears": t["linears"], "attention": t["attention"], "norms": t["norms"], "rotary": t["rotary"],
            "rest of forward": t["forward"] - inside, "runner inputs": t["execute"] - t["forward"],
            "sampling + postprocess": t["sampling + postprocess"],
            "scheduler + rest of step": t["step"] - t["execute"] - t["sampling + postprocess"]}


def profile(llm, prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, float], float, int, int]:
    """(seconds per part, wall seconds, generated tokens, steps) of one generate over `prompts`."""
    from quantkit.engine import SamplingParams

    clock = Clock()
    steps = 0
    with instrumented(clock):
        eng = llm.engine
        for p in prompts:
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        wall = time.perf_counter() - t
    return breakdown(clock), wall, len(prompts) * max_tokens, steps


def main() -> None:
    from quantkit.bench.engine_vs_vllm import MAX_MODEL_LEN, make_dense, workloads
    from quantkit.engine import LLM, SamplingParams
    from quantkit.engine.config import auto_cpu_dtype

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="a,b,c")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    dtype = auto_cpu_dtype()[0] if args.dtype == "auto" else args.dtype
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_dense(Path(tmp))), dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                  num_threads=args.threads)
    print(f"random Llama (hidden 1024, 8 layers), {dtype}, {torch.get_num_threads()} threads")
    print("| workload | tok/s | steps | ms/step | " + " | ".join(PARTS) + " |")
    print("|---|---|---|---|" + "---|" * len(PARTS))
    for w in workloads():
        if w.name not in args.workloads.split(","):
            continue
        llm.generate(w.prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
        parts, wall, tokens, steps = profile(llm, w.prompts, w.max_tokens)
        total = sum(parts.values())
        cells = " | ".join(f"{parts[p] / total:5.1%}" for p in PARTS)
        print(f"| ({w.name}) | {tokens / wall:.1f} | {steps} | {wall / steps * 1e3:.1f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
