"""Engine benchmark: our paged-KV engine against transformers' generate, in one process.

  python -m quantkit.bench.engine [--models stories,random100m] [--threads 1] [--requests 64] [--repeats 3]
  python -m quantkit.bench.engine --against-vllm VENV [--threads 2] [--rounds 3] [--gptq]   (engine_vs_vllm.py)
  python -m quantkit.bench.vs_llamacpp --llamacpp-venv VENV [--threads 2] [--rounds 3]   (batch 1 vs llama.cpp)

For each model: 64 requests of mixed prompt lengths, each generating --max-tokens tokens (EOS
ignored so every system produces the same number of tokens):
  * throughput: generated tokens/s of the engine, of HF generate one request at a time (timed on
    --serial-sample requests spread over the mix: its per-request rate does not depend on how
    many run), and
    of HF generate on all requests at once (left-padded batch); ratios printed;
  * time to first token for requests sharing a 256-token prefix, prefix caching on vs off;
  * KV utilization (tokens held / pool capacity) over the steps where requests are waiting for room:
    the same 64 requests on a 64-block pool (~8 fit), and 64 longer requests (prompts 256-448
    tokens, 64 new) on a 512-block pool (~20 fit).

  python -m quantkit.bench.engine --async-front [--models stories] [--threads 1]

measures only the async front: the same requests streamed through AsyncLLM (one engine thread,
every request's outputs consumed by its own task) against LLM.generate, in one process.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "stories260K-hf"
RANDOM_100M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                   num_key_value_heads=4, vocab_size=16384, max_position_embeddings=1024, tie_word_embeddings=True)


def make_random_model(out: Path) -> Path:
    """A randomly initialised Llama of ~100M parameters (the shape is what matters for speed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.calibration.synthetic import build_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **RANDOM_100M))
    model.save_pretrained(out)
    build_tokenizer(vocab_size=512).save_pretrained(out)
    return out


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [[1] + torch.randint(3, min(vocab, 512), (k - 1,), generator=g).tolist() for k in lengths]


def engine_throughput(llm, prompts, max_tokens: int) -> tuple[float, int]:
    """(generated tokens/s, generated tokens) of one engine run over all prompts."""
    from quantkit.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / elapsed, n


async def _async_front_run(llm, prompts, max_tokens: int) -> tuple[float, int]:
    from quantkit.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i, p):
        async for out in llm.generate(p, params, f"b{time.perf_counter_ns()}-{i}"):
            pass
        return len(out.outputs[0].token_ids)

    t = time.perf_counter()
    n = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return n / (time.perf_counter() - t), n


def async_front(name: str, path: Path, args) -> None:
    """Generated tokens/s streamed through AsyncLLM vs LLM.generate on the same engine settings."""
    from quantkit.engine import LLM, EngineConfig, SamplingParams
    from quantkit.engine.async_llm import AsyncLLM

    prompts = make_prompts(args.requests, 512, 16, 160)
    kw = dict(max_num_seqs=len(prompts), max_model_len=512)
    offline = LLM(str(path), **kw)
    offline.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm-up

    async def main():
        llm = AsyncLLM(EngineConfig(model=str(path), **kw))
        await llm.start()
        await _async_front_run(llm, prompts[:2], 2)  # warm-up
        rates = []
        for _ in range(args.repeats):  # interleaved with the offline runs
            rates.append((await _async_front_run(llm, prompts, args.max_tokens))[0])
            offline_rates.append(engine_throughput(offline, prompts, args.max_tokens)[0])
        await llm.shutdown(5)
        return max(rates)

    offline_rates: list[float] = []
    ours = asyncio.run(main())
    base = max(offline_rates)
    print(f"\n== {name}: {args.requests} requests, {args.max_tokens} new tokens each, "
          f"{torch.get_num_threads()} thread(s), best of {args.repeats} interleaved runs")
    print(f"LLM.generate      {base:9.1f} tok/s")
    print(f"AsyncLLM streams  {ours:9.1f} tok/s   AsyncLLM / LLM.generate = {ours / base:5.2f}x")


def hf_serial(model, prompts, max_tokens: int) -> float:
    tokens, t = 0, time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            tokens += out.shape[1] - len(p)
    return tokens / (time.perf_counter() - t)


def hf_batched(model, prompts, max_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - t)


def ttft_with_shared_prefix(path: Path, caching: bool, n: int = 8) -> float:
    """Mean TTFT (s) of n requests, one at a time, each a shared 256-token prefix + its own 16 tokens."""
    from quantkit.engine import LLM, SamplingParams

    llm = LLM(str(path), max_num_seqs=4, max_model_len=512, enable_prefix_caching=caching)
    g = torch.Generator().manual_seed(1)
    prefix = [1] + torch.randint(3, 512, (255,), generator=g).tolist()
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prefix + [7] * 16], one)  # warm-up, and fills the cache when caching is on
    ttfts = []
    for _ in range(n):
        out = llm.generate([prefix + torch.randint(3, 512, (16,), generator=g).tolist()], one)[0]
        ttfts.append(out.metrics.time_to_first_token)
    return statistics.mean(ttfts)


def kv_utilization_at_saturation(path: Path, prompts, max_tokens: int, num_blocks: int) -> tuple[float, float, int]:
    """Over the steps where requests wait for room: mean of tokens held / capacity, mean of blocks
    held / blocks, and the number of such steps. Measured at the forward, when the pool is fullest."""
    from quantkit.engine import LLM, SamplingParams

    llm = LLM(str(path), max_num_seqs=len(prompts), max_model_len=512, num_kv_blocks=num_blocks)
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    tokens, blocks = [], []
    while eng.has_unfinished_requests():
        eng.step()
        if eng.last_step.num_waiting:  # saturated: someone is waiting for room
            tokens.append(eng.last_step.kv_tokens / eng.kv_plan.capacity_tokens)
            blocks.append(eng.last_step.kv_block_usage)
    return statistics.mean(tokens), statistics.mean(blocks), len(tokens)


def bench_model(name: str, path: Path, args) -> None:
    from transformers import AutoModelForCausalLM

    from quantkit.engine import LLM, SamplingParams

    prompts = make_prompts(args.requests, 512, 16, 160)
    stride = max(1, len(prompts) // args.serial_sample)
    sample = prompts[::stride][:args.serial_sample]  # spread over the mix of prompt lengths
    llm = LLM(str(path), max_num_seqs=len(prompts), max_model_len=512)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours, serial, batched = [], [], []
    for _ in range(args.repeats):  # interleaved, best of each: the machine's load drifts between runs
        rate, n_tokens = engine_throughput(llm, prompts, args.max_tokens)
        ours.append(rate)
        serial.append(hf_serial(hf, sample, args.max_tokens))
        batched.append(hf_batched(hf, prompts, args.max_tokens))
    ours, serial, batched = max(ours), max(serial), max(batched)
    del hf, llm
    on, off = ttft_with_shared_prefix(path, True), ttft_with_shared_prefix(path, False)
    token_u, block_u, steps = kv_utilization_at_saturation(path, prompts, args.max_tokens, 64)
    # longer requests on a pool that holds ~20 of them: the half-empty last block of each running
    # request, and the room left while the head of the queue waits, are then smaller fractions
    long_prompts = make_prompts(args.requests, 512, 256, 448, seed=2)
    long_u, long_block_u, long_steps = kv_utilization_at_saturation(path, long_prompts, 64, 512)
    print(f"\n== {name}: {args.requests} requests, prompts 16-160 tokens, {args.max_tokens} new tokens each "
          f"({n_tokens} tokens), {torch.get_num_threads()} thread(s), best of {args.repeats} interleaved runs")
    print(f"engine            {ours:9.1f} tok/s")
    mean_len = statistics.mean(len(p) for p in prompts)
    print(f"HF one at a time  {serial:9.1f} tok/s   engine / serial  = {ours / serial:5.2f}x "
          f"(timed on {len(sample)} of the requests, mean prompt {statistics.mean(len(p) for p in sample):.0f} "
          f"tokens vs {mean_len:.0f} for all)")
    print(f"HF batched        {batched:9.1f} tok/s   engine / batched = {ours / batched:5.2f}x")
    print(f"TTFT, shared 256-token prefix: caching on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, "
          f"off / on = {off / on:.2f}x")
    print(f"KV at saturation (64 blocks x 16 tokens, mean over {steps} steps with requests waiting): "
          f"tokens held / capacity {token_u:.1%}, blocks held / blocks {block_u:.1%}")
    print(f"KV at saturation, prompts 256-448 tokens + 64 new, 512 blocks x 16 tokens (mean over {long_steps} "
          f"steps): tokens held / capacity {long_u:.1%}, blocks held / blocks {long_block_u:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="stories,random100m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--serial-sample", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of each system; the best counts")
    ap.add_argument("--against-vllm", metavar="VENV", help="compare with vLLM's CPU build in VENV (workloads a-c)")
    ap.add_argument("--rounds", type=int, default=3, help="--against-vllm: alternating rounds; the median counts")
    ap.add_argument("--dtype", default="auto", help="--against-vllm: both systems' dtype (auto: ours for this CPU)")
    ap.add_argument("--workloads", default="a,b,c", help="--against-vllm: which of a, b, c, d8, d32")
    ap.add_argument("--gptq", action="store_true", help="--against-vllm: also the model's 4-bit GPTQ checkpoint")
    ap.add_argument("--gptq-only", action="store_true", help="--against-vllm: only the 4-bit GPTQ checkpoint")
    ap.add_argument("--vllm-log", default="out/vllm-bench.log", help="--against-vllm: where vLLM's stderr goes")
    ap.add_argument("--async-front", action="store_true", help="only AsyncLLM streaming vs LLM.generate")
    args = ap.parse_args()
    if args.against_vllm:
        from quantkit.bench.engine_vs_vllm import run

        return run(args)
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        if name == "stories":
            (async_front if args.async_front else bench_model)("stories260K-hf", STORIES, args)
        elif name == "random100m":
            with tempfile.TemporaryDirectory() as tmp:
                (async_front if args.async_front else bench_model)(
                    "random Llama ~100M (hidden 768, 12 layers)", make_random_model(Path(tmp)), args)
        else:
            raise SystemExit(f"unknown model {name!r}; expected stories or random100m")


if __name__ == "__main__":
    main()
