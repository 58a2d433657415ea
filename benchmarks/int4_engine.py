"""Decode speed of the engine on a 4-bit GPTQ checkpoint against the same model in float, one process.

  python benchmarks/int4_engine.py [--threads 2] [--batches 1,8] [--prompt-len 128] [--max-tokens 64]
                                       [--rounds 3] [--dtype auto] [--models-dir DIR] [--make-only]
                                       [--int8-activations] [--other-lm-head]

Model: the random Llama of the vLLM comparison (hidden 1024, intermediate 2816, 8 layers, 16 heads, 8 KV heads,
vocab 32000; quantkit/bench/engine_vs_vllm.py), saved in bf16, and its 4-bit RTN checkpoint in the GPTQ v1 layout
(symmetric, group 128), with lm_head float and with lm_head packed too (`quantize --quantize-lm-head`). All load in
--dtype (auto: the engine's pick for this CPU). Decode tokens/s at batch B = B * (max_tokens - 1) / (time of B
prompts to max_tokens - time of the same prompts to 1 token): the prefill and first token are taken out. Rounds
alternate float and 4-bit, in reverse order every other round (quantkit.bench.rounds); the median counts, and beside
it the median of each round's ratio to the float model's run in that round, with their quartiles. Weight memory is
the engine's start-up figure.
--models-dir keeps the checkpoints (made once, reused), so `--make-only` can build them before a timed run.
Each checkpoint runs with the engine's defaults: the 4-bit GPTQ checkpoint's float lm_head is held in int8
(EngineConfig.cpu_int8_lm_head, where the int8 kernel is built), the float model's stays float.
--int8-activations adds both 4-bit checkpoints again with EngineConfig.cpu_int8_activations (decode batches
on the W4A8 kernel: activations rounded to int8 per row and group). --other-lm-head adds each float lm_head
the other way: the float model's in int8, the 4-bit one's float (with --int8-activations too, also W4A8 with
a float head).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from quantkit.bench.rounds import per_round, round_order


def _wall(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from quantkit.engine import SamplingParams

    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - t


def decode_tok_s(llm, prompts: list[list[int]], max_tokens: int) -> float:
    full, first = _wall(llm, prompts, max_tokens), _wall(llm, prompts, 1)
    return len(prompts) * (max_tokens - 1) / (full - first)


def decode_args(ap: argparse.ArgumentParser, max_tokens: int, rounds: int) -> None:
    """The options of a decode-speed benchmark: threads, batch sizes, prompt and output lengths, rounds, dtype."""
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--dtype", default="auto")


def checkpoints(root: Path) -> dict[str, Path]:
    """The float model and its two 4-bit checkpoints under `root`, made where missing."""
    from quantkit.bench.engine_vs_vllm import make_dense, make_gptq

    root.mkdir(parents=True, exist_ok=True)
    dense = root / "bf16" if (root / "bf16" / "config.json").is_file() else make_dense(root)
    made = {name: root / name for name in ("gptq", "gptq-lm-head") if (root / name / "config.json").is_file()}
    return {"float": dense, "4-bit GPTQ": made.get("gptq") or make_gptq(dense, root),
            "4-bit GPTQ + lm_head": made.get("gptq-lm-head") or make_gptq(dense, root, lm_head=True)}


def variants(models: dict[str, Path], int8_activations: bool, other_head: bool
             ) -> list[tuple[str, Path, bool, bool | None]]:
    """(name, checkpoint, cpu_int8_activations, cpu_int8_lm_head) of every run: each checkpoint with the engine's
    defaults (None: a 4-bit checkpoint's float head is held in int8, the float model's stays float), then the
    4-bit ones with int8 activations, then each float head the other way (and, with both flags, the 4-bit one
    with int8 activations and a float head)."""
    runs = [(name, path, False, None) for name, path in models.items()]
    if int8_activations:
        runs += [(f"{name}, int8 activations", path, True, None) for name, path in models.items() if name != "float"]
    if other_head:
        float_head = [(name, path) for name, path in models.items() if "lm_head" not in name]
        runs += [(f"{name}, {'int8' if name == 'float' else 'float'} lm_head", path, False, name == "float")
                 for name, path in float_head]
        if int8_activations:
            runs += [(f"{name}, int8 activations, float lm_head", path, True, False) for name, path in float_head
                     if name != "float"]
    return runs


def main() -> None:
    from quantkit.engine import LLM
    from quantkit.devices import auto_cpu_dtype
    from quantkit.engine.weights import WeightMemory

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    decode_args(ap, max_tokens=64, rounds=3)
    ap.add_argument("--models-dir", type=Path, default=None, help="make the checkpoints here once and reuse them")
    ap.add_argument("--make-only", action="store_true", help="only make the checkpoints in --models-dir")
    ap.add_argument("--int8-activations", action="store_true", help="also the 4-bit checkpoints with W4A8 decode")
    ap.add_argument("--other-lm-head", action="store_true",
                    help="also each float lm_head the other way (int8 for the float model, float for the 4-bit one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = auto_cpu_dtype()[0] if args.dtype == "auto" else args.dtype
    g = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: [torch.randint(3, 32000, (args.prompt_len,), generator=g).tolist() for _ in range(b)]
               for b in batches}
    with tempfile.TemporaryDirectory() as tmp:
        models = checkpoints(args.models_dir or Path(tmp))
        if args.make_only:
            return
        llms = {name: LLM(str(path), dtype=dtype, max_model_len=1024, max_num_seqs=max(batches),
                          num_threads=args.threads, cpu_int8_activations=act, cpu_int8_lm_head=head)
                for name, path, act, head in variants(models, args.int8_activations, args.other_lm_head)}
        for name, llm in llms.items():  # warm-up at every batch size (a first batch-8 step ran 4x slower), not counted
            for b in batches:
                _wall(llm, prompts[b], 2)
            print(f"{name}: {WeightMemory.of(llm.engine.model).describe()}", flush=True)
        rates = {(name, b): [] for name in llms for b in batches}
        loads = [os.getloadavg()[0]]
        for r in range(args.rounds):
            for b in batches:
                for name, llm in round_order(list(llms.items()), r):
                    rates[name, b].append(decode_tok_s(llm, prompts[b], args.max_tokens))
                    print(f"  round: batch {b} {name} {rates[name, b][-1]:.1f} tok/s", flush=True)
            loads.append(os.getloadavg()[0])
    print(f"{dtype}, {args.threads} threads, prompts of {args.prompt_len} tokens, {args.max_tokens} out, median "
          f"of {args.rounds} alternating rounds; load average {min(loads):.2f}-{max(loads):.2f}")
    for b in batches:
        f = statistics.median(rates["float", b])
        # (the median of each round's ratio to the float run beside it: a machine whose speed drifts between
        # rounds moves both runs of a round together)
        parts = [f"{n} {statistics.median(rates[n, b]):.1f} ({statistics.median(rates[n, b]) / f:.2f}x; per round "
                 f"{per_round(rates[n, b], rates['float', b])})" for n in llms if n != "float"]
        rounds = "; ".join(f"{n} " + ", ".join(f"{r:.1f}" for r in rates[n, b]) for n in llms)
        print(f"batch {b}: decode tok/s float {f:.1f}, " + ", ".join(parts) + f"; rounds {rounds}", flush=True)


if __name__ == "__main__":
    main()
