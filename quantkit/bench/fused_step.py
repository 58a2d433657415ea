"""What the decode step's small-op fusions buy, one process: the engine as it runs (rotary and the KV cache write
in one op reading the rope table, `Decoder.use_rope_table`; the greedy argmax in C++, `cpu_fused.argmax_rows`)
against the same engine with per-step cos/sin, rotary, split copies and `index_copy_` cache writes, and torch's
argmax, in alternating rounds.

  python -m quantkit.bench.fused_step MODEL [MODEL ...] [--threads 2] [--batches 1,8] [--prompt-len 128]
                                      [--max-tokens 48] [--rounds 9] [--dtype auto] [--max-model-len 1024]

Decode tokens/s as quantkit.bench.int4_engine measures it (the prefill and first token taken out); per batch
size: the median of each setting and the median of each round's ratio (fused / unfused).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch


@contextlib.contextmanager
def unfused(llm):
    """Within the block, `llm` computes cos/sin each step and takes torch's argmax."""
    from quantkit.engine import sampler

    model, argmax = llm.engine.model, sampler.argmax_rows
    limit, model.rope_limit = model.rope_limit, None
    sampler.argmax_rows = lambda x: x.argmax(dim=-1)
    try:
        yield
    finally:
        model.rope_limit, sampler.argmax_rows = limit, argmax


def main() -> None:
    from quantkit.bench.int4_engine import _wall, decode_args, decode_tok_s
    from quantkit.devices import auto_cpu_dtype
    from quantkit.engine import LLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    decode_args(ap, max_tokens=48, rounds=9)
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = auto_cpu_dtype()[0] if args.dtype == "auto" else args.dtype
    g = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{dtype}, {args.threads} threads, prompts of {args.prompt_len} tokens, {args.max_tokens} out, "
          f"{args.rounds} alternating rounds")
    for path in args.models:
        llm = LLM(path, dtype=dtype, max_model_len=args.max_model_len, max_num_seqs=max(batches),
                  num_threads=args.threads)
        if llm.engine.model.rope_limit is None:
            raise SystemExit(f"{path}: the engine built no rope table here (not on CPU, or a partial rotary)")
        for b in batches:
            vocab = llm.engine.model.shape.vocab_size
            prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(b)]
            _wall(llm, prompts, 2)  # warm-up at this batch size, not counted
            fused, plain = [], []
            for _ in range(args.rounds):
                fused.append(decode_tok_s(llm, prompts, args.max_tokens))
                with unfused(llm):
                    plain.append(decode_tok_s(llm, prompts, args.max_tokens))
            ratio = statistics.median(f / p for f, p in zip(fused, plain))
            print(f"{path} batch {b}: fused {statistics.median(fused):.1f} tok/s, unfused "
                  f"{statistics.median(plain):.1f}, per round fused / unfused {ratio:.3f}x", flush=True)


if __name__ == "__main__":
    main()
