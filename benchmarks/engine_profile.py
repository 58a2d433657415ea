"""Where an engine step's time goes, on the workloads of the vLLM comparison (engine_vs_vllm.py).

  python benchmarks/engine_profile.py [--threads 2] [--workloads a,b,c] [--dtype auto] [--paths torch,cpp]
                                         [--decode-batch 8] [--prefill 8:256] [--model PATH]
                                         [--int8-activations] [--lm-head auto|int8|float]
                                         [--float-linears auto|onednn] [--decode-only]

--decode-batch N adds a workload "c xN": N requests of (c)'s shape (128 in, 128 out) decoding together.
--prefill N:LEN adds "prefill NxLEN": N random prompts of LEN tokens, one token out (one prefill step when
N x LEN fits the step's token budget), on fresh prompts each repeat (no prefix-cache hits).
--decode-only counts only the steps that compute no prompt token: a batch's decode, its prefill left out.
--float-linears onednn loads the float linears as oneDNN-prepacked where the engine would run quantkit's bf16
kernel (benchmarks/bf16_dot.py).
--model PATH profiles that checkpoint instead of the random 1024-hidden Llama (`--workloads ""` with it
when its vocabulary is smaller than (a)-(c)'s token ids).

--paths: `cpp` is the engine as it runs (the C++ paged attention and fused ops where they build),
`torch` the same engine with both switched off in this process (the fallback path: the torch
reference ops and the gather + SDPA attention), `cpp-per-row` the C++ path with the AVX-512
attention step folding each row over a block on its own (never the widened block), `cpp-single-rows`
the C++ path without the per-row step's pairs (two rows that see the same keys folded in one pass);
same model, same process, one after the other.

Each part of the step is wrapped (in this process only) by a wall-clock accumulator: the linears
(every linear's forward: float, prepacked, bf16 and quantized), attention (the cache write, the reads of the paged cache and the
softmax), norms (RMSNorm, fused residual add included), rotary (cos/sin and their application; where the
engine's rope table runs, the one op that rotates q and k and writes the cache, so the cache write counts
here and not under attention), SiLU-and-mul, the rest of the forward (embedding, row selection, per-layer Python),
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

PARTS = ("linears", "attention", "norms", "rotary", "silu-and-mul", "rest of forward", "runner inputs",
         "sampling + postprocess", "scheduler + rest of step")


class Clock:
    """Wall time accumulated per label; nested labels are subtracted from their parents later."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.depth: dict[str, int] = defaultdict(int)  # a label counts once when its wrapped calls nest

    def wrap(self, owner, attr: str, label: str):
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            self.depth[label] += 1
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth[label] -= 1
                if not self.depth[label]:
                    self.total[label] += time.perf_counter() - t

        setattr(owner, attr, timed)
        return original


@contextlib.contextmanager
def torch_path():
    """Within the block, the engine runs its torch fallback: no C++ attention, no fused ops."""
    from quantkit.engine import attention, decoder
    from quantkit.kernels import fused_ops_reference

    saved = attention.use_cpu_kernel, decoder.ops_for
    attention.use_cpu_kernel = lambda device, dtype: False
    decoder.ops_for = lambda x: fused_ops_reference
    try:
        yield
    finally:
        attention.use_cpu_kernel, decoder.ops_for = saved


@contextlib.contextmanager
def per_row_attention():
    """Within the block, the C++ attention's AVX-512 step never widens a block for many rows."""
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    mod = cpu_attention()
    old = mod.dev.set_widen_from_rows(1 << 40) if mod is not None else -1
    try:
        yield
    finally:
        if old > 0:
            mod.dev.set_widen_from_rows(old)


@contextlib.contextmanager
def single_rows_attention():
    """Within the block, the C++ attention's per-row step folds every row alone (never two rows together)."""
    from quantkit.kernels.paged_attention_cpu import cpu_attention

    mod = cpu_attention()
    old = mod.dev.set_pair_rows(False) if mod is not None else -1
    try:
        yield
    finally:
        if old >= 0:
            mod.dev.set_pair_rows(bool(old))


LM_HEAD = {"auto": None, "int8": True, "float": False}
PATHS = {"cpp": contextlib.nullcontext, "torch": torch_path, "cpp-per-row": per_row_attention,
         "cpp-single-rows": single_rows_attention}


@contextlib.contextmanager
def instrumented(clock: Clock):
    """Wrap the engine's parts in `clock` for the duration of the block."""
    from quantkit.engine import decoder, llm_engine, model_runner, rope
    from quantkit.kernels import bf16_cpu, cpu_fused, cpu_linear, fused_ops_reference, int8_cpu
    from quantkit.model.quant_linear import QuantLinear

    targets = [(llm_engine.LLMEngine, "step", "step"), (model_runner.ModelRunner, "execute", "execute"),
               (decoder.Decoder, "forward", "forward"), (cpu_linear.PrepackedLinear, "forward", "linears"),
               (torch.nn.Linear, "forward", "linears"), (QuantLinear, "forward", "linears"),
               (bf16_cpu.Bf16Linear, "forward", "linears"), (bf16_cpu.Bf16DotLinear, "forward", "linears"),
               (int8_cpu.Int8Linear, "forward", "linears"),
               (decoder, "paged_attention", "attention"), (decoder, "attend", "attention"),
               (rope.StepRope, "cos_sin", "rotary"), (llm_engine.LLMEngine, "_postprocess", "sampling + postprocess")]
    for ops in (cpu_fused, fused_ops_reference):
        targets += [(ops, "rms_norm", "norms"), (ops, "add_rms_norm", "norms"), (ops, "rotary", "rotary"),
                    (ops, "rope_and_cache", "rotary"), (ops, "silu_and_mul", "silu-and-mul")]
    originals = [(owner, attr, clock.wrap(owner, attr, label)) for owner, attr, label in targets]
    try:
        yield
    finally:
        for owner, attr, original in reversed(originals):
            setattr(owner, attr, original)


def breakdown(clock: Clock) -> dict[str, float]:
    t = clock.total
    inside = sum(t[k] for k in ("linears", "attention", "norms", "rotary", "silu-and-mul"))
    return {"linears": t["linears"], "attention": t["attention"], "norms": t["norms"], "rotary": t["rotary"],
            "silu-and-mul": t["silu-and-mul"],
            "rest of forward": t["forward"] - inside, "runner inputs": t["execute"] - t["forward"],
            "sampling + postprocess": t["sampling + postprocess"],
            "scheduler + rest of step": t["step"] - t["execute"] - t["sampling + postprocess"]}


def profile(llm, prompts: list[list[int]], max_tokens: int,
            decode_only: bool = False) -> tuple[dict[str, float], float, int, int]:
    """(seconds per part, wall seconds, generated tokens, steps) of one generate over `prompts`; with
    `decode_only`, of its steps that compute no prompt token (one token a running request)."""
    from quantkit.engine import SamplingParams

    clock = Clock()
    steps = tokens = 0
    wall = 0.0
    with instrumented(clock):
        eng = llm.engine
        for p in prompts:
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while eng.has_unfinished_requests():
            before = dict(clock.total)
            t = time.perf_counter()
            eng.step()
            took = time.perf_counter() - t
            ran = eng.last_step
            if decode_only:
                if ran.num_scheduled_tokens > ran.num_running:  # a prompt token in the step: not counted
                    clock.total = defaultdict(float, before)
                    continue
                tokens += ran.num_running  # one token a running request
            wall += took
            steps += 1
    return breakdown(clock), wall, tokens if decode_only else len(prompts) * max_tokens, steps


def batched_c(n: int):
    """n requests of workload (c)'s shape: 128 random prompt tokens each, 128 out."""
    from quantkit.bench.engine_vs_vllm import Workload

    g = torch.Generator().manual_seed(1)
    return Workload(f"c x{n}", [torch.randint(3, 32000, (128,), generator=g).tolist() for _ in range(n)], 128)


def prefill(n: int, length: int, vocab: int, seed: int):
    """n random prompts of `length` tokens, one token out."""
    from quantkit.bench.engine_vs_vllm import Workload

    g = torch.Generator().manual_seed(seed)
    return Workload(f"prefill {n}x{length}", [torch.randint(3, vocab, (length,), generator=g).tolist()
                                              for _ in range(n)], 1)


def main() -> None:
    from bf16_dot import onednn_linears
    from quantkit.bench.engine_vs_vllm import MAX_MODEL_LEN, make_dense, workloads
    from quantkit.engine import LLM, SamplingParams
    from quantkit.devices import auto_cpu_dtype

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="a,b,c")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--paths", default="cpp", help=f"a comma-separated list of {', '.join(PATHS)}")
    ap.add_argument("--decode-batch", type=int, default=0, help="also N requests of (c)'s shape together")
    ap.add_argument("--prefill", help="N:LEN: also N prompts of LEN tokens, one token out")
    ap.add_argument("--decode-only", action="store_true",
                    help="count only the steps that compute no prompt token (the decode of a batch)")
    ap.add_argument("--repeats", type=int, default=1, help="profile each workload this many times")
    ap.add_argument("--model", help="a checkpoint to profile (default: the random 1024-hidden Llama)")
    ap.add_argument("--int8-activations", action="store_true", help="EngineConfig.cpu_int8_activations")
    ap.add_argument("--lm-head", choices=tuple(LM_HEAD), default="auto",
                    help="EngineConfig.cpu_int8_lm_head: auto (the engine's default), int8 or float")
    ap.add_argument("--float-linears", choices=("auto", "onednn"), default="auto",
                    help="auto: the engine's choice; onednn: oneDNN's prepacked GEMM even where the bf16 kernel runs")
    args = ap.parse_args()
    if unknown := set(args.paths.split(",")) - set(PATHS):
        ap.error(f"unknown paths {sorted(unknown)}: choose from {', '.join(PATHS)}")
    dtype = auto_cpu_dtype()[0] if args.dtype == "auto" else args.dtype
    n_prefill, prefill_len = (int(v) for v in args.prefill.split(":")) if args.prefill else (0, 0)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_dense(Path(tmp)))
        with onednn_linears() if args.float_linears == "onednn" else contextlib.nullcontext():
            llm = LLM(model, dtype=dtype, max_model_len=max(MAX_MODEL_LEN, prefill_len + 2), max_num_seqs=64,
                      num_threads=args.threads,
                      cpu_int8_activations=args.int8_activations, cpu_int8_lm_head=LM_HEAD[args.lm_head])
    flags = [f for f, on in (("int8 activations", args.int8_activations),
                             (f"{args.lm_head} lm_head", args.lm_head != "auto"),
                             ("oneDNN float linears", args.float_linears == "onednn")) if on]
    name = (args.model or "random Llama (hidden 1024, 8 layers)") + "".join(f", {f}" for f in flags)
    print(f"{name}, {dtype}, {torch.get_num_threads()} threads")
    print("| workload | path | tok/s | steps | ms/step | " + " | ".join(PARTS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(PARTS))
    chosen = [w for w in workloads() if w.name in args.workloads.split(",")]
    if args.decode_batch:
        chosen.append(batched_c(args.decode_batch))
    if args.prefill:  # the engine's context fits the prompts (max_model_len above)
        vocab = llm.engine.tokenizer.vocab_size
        chosen += [prefill(n_prefill, prefill_len, vocab, seed) for seed in range(args.repeats)]
    chosen = [w for w in chosen for _ in range(1 if w.name.startswith("prefill") else args.repeats)]
    for w in chosen:
        for path in args.paths.split(","):
            with PATHS[path]():
                llm.generate(w.prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
                if w.name.startswith("prefill"):  # every prompt token computed in the timed run
                    llm.engine.kv.pool.reset_prefix_cache()
                parts, wall, tokens, steps = profile(llm, w.prompts, w.max_tokens, args.decode_only)
            total = sum(parts.values())
            cells = " | ".join(f"{parts[p] / total:5.1%}" for p in PARTS)
            print(f"| ({w.name}) | {path} | {tokens / wall:.1f} | {steps} | {wall / steps * 1e3:.1f} | {cells} |",
                  flush=True)


if __name__ == "__main__":
    main()
