"""The model steps of the GPU check (quantkit.bench.gpu_check), each run in a child process:

  python -m quantkit.bench.gpu_steps {model,gptq,engine} RESULT.json WORKDIR [--dry-run]

  model   a random Llama with TinyLlama-1.1B's shapes (22 layers, bf16) saved in WORKDIR/model
  gptq    `quantize --method gptq` of it on the GPU: seconds per layer, peak GPU memory
  engine  the paged-KV engine on the GPU over the float model and the GPTQ checkpoint: tokens/s,
          and how many times the Triton paged-attention kernel ran (it must run)

Each step writes its figures to RESULT.json as it gets them, so a step that fails half-way still
reports what it measured. With --dry-run every step runs at toy size on CPU tensors, with the
engine's decode attention routed through the Triton kernel in the interpreter (TRITON_INTERPRET=1
is set by gpu_check), so the whole path is exercised before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.bench.peak_rss import peak_rss_bytes
from quantkit.bench.runs import ONE_B, make_random_llama

GiB = 1024**3


@dataclass(frozen=True)
class Sizes:
    layers: int
    shape: dict
    group_size: int
    nsamples: int  # calibration windows
    seqlen: int
    requests: int  # engine requests, prompts of prompt_lens tokens, max_tokens new tokens each
    prompt_lens: tuple[int, int]
    max_tokens: int
    num_kv_blocks: int  # of 16 tokens
    max_model_len: int


GPU_SIZES = Sizes(layers=22, shape=ONE_B, group_size=128, nsamples=128, seqlen=512, requests=64,
                  prompt_lens=(16, 160), max_tokens=128, num_kv_blocks=2048, max_model_len=1024)
TOY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)
DRY_SIZES = Sizes(layers=2, shape=TOY_SHAPE, group_size=64, nsamples=4, seqlen=64, requests=4,
                  prompt_lens=(8, 24), max_tokens=4, num_kv_blocks=32, max_model_len=128)


class Results:
    """A step's figures, written to its JSON file after every update."""

    def __init__(self, path: Path):
        self.path, self.data = path, {}

    def update(self, **figures) -> None:
        self.data.update(figures)
        self.path.write_text(json.dumps(self.data, indent=1))


def step_model(work: Path, sizes: Sizes, results: Results) -> None:
    start = time.perf_counter()
    path = make_random_llama(work / "model", sizes.layers, sizes.shape)
    on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    s = sizes.shape
    results.update(seconds=time.perf_counter() - start, layers=sizes.layers, disk_gib=on_disk / GiB,
                   params_m=on_disk / 2 / 1e6,  # bf16 on disk: 2 bytes per parameter
                   shape=f"hidden {s['hidden_size']}, intermediate {s['intermediate_size']}, "
                         f"{s['num_attention_heads']}/{s['num_key_value_heads']} heads, vocab {s['vocab_size']}")


def step_gptq(work: Path, sizes: Sizes, device: torch.device, results: Results) -> None:
    from quantkit.calibration.synthetic import make_corpus
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.quant.pipeline import quantize_model

    calib = work / "calib.txt"  # synthetic stories: no data set needed on the GPU machine
    calib.write_text("\n\n".join(make_corpus(max(200, 8 * sizes.nsamples))))
    out = work / "gptq"
    out.mkdir(exist_ok=True)
    cfg = QuantizeConfig(model=str(work / "model"), out=out, method="gptq", group_size=sizes.group_size,
                         calib=CalibConfig(source=str(calib), nsamples=sizes.nsamples, seqlen=sizes.seqlen),
                         device=device.type)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    report = quantize_model(cfg, out, show_progress=False)
    per_layer = [layer.seconds for layer in report.layers]
    results.update(
        seconds=report.seconds, layers=len(per_layer), layer_s_mean=statistics.mean(per_layer),
        layer_s_min=min(per_layer), layer_s_max=max(per_layer), quantized_linears=len(report.plan.quantized),
        calib=f"{sizes.nsamples} x {sizes.seqlen} tokens of synthetic stories", group_size=sizes.group_size,
        peak_gpu_gib=torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None,
        peak_rss_gib=peak_rss_bytes() / GiB)


@contextmanager
def counting_paged_attention(device: torch.device) -> Iterator[list[int]]:
    """Count the engine's calls of the Triton paged decode-attention kernel ([count], updated live).

    On CUDA the engine calls the compiled kernel itself (quantkit.engine.attention imports it from
    quantkit.kernels.paged_attention at each call): the count wraps it. On CPU the engine runs the
    torch reference (the C++ CPU kernel switched off for the block); for the dry run its decode
    attention is routed through the kernel in Triton's interpreter, which takes the same arguments.
    """
    import quantkit.engine.attention as attention
    import quantkit.kernels.paged_attention as compiled
    from quantkit.kernels.triton_w4a16 import private_copy

    if device.type == "cuda":
        owner, name, kernel = compiled, "paged_decode_attention", compiled.paged_decode_attention
    else:
        interpreted = private_copy("quantkit.kernels.paged_attention", interpret=True)
        owner, name, kernel = attention, "paged_decode_attention_reference", interpreted.paged_decode_attention
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return kernel(*args, **kwargs)

    original, cpu_kernel = getattr(owner, name), attention.use_cpu_kernel
    setattr(owner, name, counted)
    if device.type != "cuda":
        attention.use_cpu_kernel = lambda device, dtype: False
    try:
        yield calls
    finally:
        setattr(owner, name, original)
        attention.use_cpu_kernel = cpu_kernel


def engine_run(path: Path, sizes: Sizes, device: torch.device) -> dict:
    """Tokens/s of one batched generate over `sizes.requests` prompts (after a warm-up that compiles)."""
    from quantkit.bench.engine import make_prompts
    from quantkit.engine import LLM, SamplingParams

    prompts = make_prompts(sizes.requests, sizes.shape["vocab_size"], *sizes.prompt_lens)
    with counting_paged_attention(device) as calls:
        llm = LLM(str(path), device=device.type, max_num_seqs=sizes.requests, max_model_len=sizes.max_model_len,
                  num_kv_blocks=sizes.num_kv_blocks)
        # warm-up on the whole workload: Triton compiles, and the W4A16 kernel autotunes each shape and M bucket
        # that the timed run meets (prefill chunks, decode at the full batch), outside the timing
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=sizes.max_tokens, ignore_eos=True))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if calls[0] == 0:
        raise RuntimeError(f"{path.name}: the engine never called the Triton paged-attention kernel")
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "kernel_calls": calls[0],
            "dtype": str(getattr(llm.engine, "dtype", "?")).removeprefix("torch.")}


def step_engine(work: Path, sizes: Sizes, device: torch.device, results: Results) -> None:
    lo, hi = sizes.prompt_lens
    results.update(workload=f"{sizes.requests} requests, prompts {lo}-{hi} tokens, {sizes.max_tokens} new tokens "
                            f"each (EOS ignored), greedy, pool of {sizes.num_kv_blocks} blocks x 16 tokens")
    failures = []
    for name in ("model", "gptq"):
        if not (work / name / "config.json").is_file():
            failures.append(f"{name}: no checkpoint (its step failed)")
            continue
        try:
            results.update(**{name: engine_run(work / name, sizes, device)})
        except Exception as exc:  # recorded, then the next checkpoint still runs; the step fails below
            results.update(**{name: {"error": f"{type(exc).__name__}: {exc}"}})
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    if failures:
        raise SystemExit("engine: " + "; ".join(failures))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one model step of the GPU check")
    p.add_argument("step", choices=("model", "gptq", "engine"))
    p.add_argument("result", type=Path)
    p.add_argument("work", type=Path)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --dry-run to exercise the steps on CPU)")
    results = Results(args.result)
    if args.step == "model":
        step_model(args.work, sizes, results)
    elif args.step == "gptq":
        step_gptq(args.work, sizes, device, results)
    else:
        step_engine(args.work, sizes, device, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
