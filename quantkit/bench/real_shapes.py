"""Models of the shapes users run, with random weights, for speed work at real sizes; and the machine's memory read
bandwidth, the bound of a memory-bound decode.

  python -m quantkit.bench.real_shapes build llama-3.2-1b [--out DIR] [--gptq] [--awq]
  python -m quantkit.bench.real_shapes build llama-3.1-8b --gptq
  python -m quantkit.bench.real_shapes build llama-3.1-8b --layers 2   # the shape cut to 2 decoder layers
  python -m quantkit.bench.real_shapes bandwidth [--threads 2] [--gib 2] [--loop stream|sum] [--repeats 5]

`build` writes a bf16 Llama of the named shape (SHAPES: Llama-3.2-1B's and Llama-3.1-8B's configs, vocab 128256)
into ~/.cache/quantkit/real-shapes/NAME (or --out), streamed shard by shard so that the 8B model is never whole in
memory, with weights drawn as transformers initialises a Llama (normal, std `initializer_range` 0.02; norms at 1),
which leaves the logits far from flat (std about 0.02 sqrt(hidden): 0.9 at 1B, 1.3 at 8B). The tokenizer is a
byte-level BPE trained on the synthetic corpus, padded with reserved tokens to the model's vocabulary (benchmarks feed
token ids). --gptq / --awq also write its 4-bit checkpoints
(`quantkit quantize --method rtn`, group 128: RTN packs at the speed such work needs). Everything is written to a
temporary folder and renamed, and reused when present. --layers N keeps only N decoder layers (config
num_hidden_layers N; the embeddings, lm_head and every layer as the full shape's), in a folder of its own,
NAME-Nlayers: a layer of the 8B shape for quantization work without the 16 GB model.

`bandwidth` times a streaming read over a buffer far larger than the caches at the given threads (quantkit.kernels.
stream_read, as STREAM's and likwid-bench's read kernels, at several prefetch distances; beside it torch's fp32 sum),
on 4 KiB pages and on transparent huge pages (as the engine holds its weights, quantkit.engine.huge_pages): bytes
read per second, the ceiling of a decode step that reads every weight once (tokens/s <= bandwidth / bytes read per
token).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

GiB = 1024**3
INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range


@dataclass(frozen=True)
class RealShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_scaling: dict | None = None
    rope_theta: float = 500000.0
    max_position: int = 131072

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-3.2-1b": RealShape("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, True, _LLAMA3_ROPE),
    "llama-3.1-8b": RealShape("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, False,
                              {**_LLAMA3_ROPE, "factor": 8.0}),
}


def with_layers(shape: RealShape, layers: int | None) -> RealShape:
    """`shape` cut to `layers` decoder layers, named NAME-Nlayers (its own cache folder); `shape` itself for None."""
    if layers is None:
        return shape
    if not 1 <= layers <= shape.layers:
        raise SystemExit(f"--layers: {shape.name} has 1 to {shape.layers} decoder layers (got {layers})")
    return dataclasses.replace(shape, name=f"{shape.name}-{layers}layers", layers=layers)


def hf_config(shape: RealShape) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "intermediate_size": shape.intermediate, "vocab_size": shape.vocab,
            "tie_word_embeddings": shape.tied, "rope_theta": shape.rope_theta, "rope_scaling": shape.rope_scaling,
            "max_position_embeddings": shape.max_position, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "initializer_range": INIT_STD, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0, "attention_bias": False, "mlp_bias": False}


def tensor_shapes(shape: RealShape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in a Llama checkpoint's order: name and shape."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    yield "model.embed_tokens.weight", (shape.vocab, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.self_attn.q_proj.weight", (h, h)
        yield f"{p}.self_attn.k_proj.weight", (kv, h)
        yield f"{p}.self_attn.v_proj.weight", (kv, h)
        yield f"{p}.self_attn.o_proj.weight", (h, h)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.mlp.gate_proj.weight", (shape.intermediate, h)
        yield f"{p}.mlp.up_proj.weight", (shape.intermediate, h)
        yield f"{p}.mlp.down_proj.weight", (h, shape.intermediate)
    yield "model.norm.weight", (h,)
    if not shape.tied:
        yield "lm_head.weight", (shape.vocab, h)


def num_parameters(shape: RealShape) -> int:
    return sum(torch.Size(s).numel() for _, s in tensor_shapes(shape))


def random_tensor(name: str, size: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """As transformers initialises a Llama: norms at 1, every weight normal with std INIT_STD; bf16."""
    if len(size) == 1:
        return torch.ones(size, dtype=torch.bfloat16)
    return (torch.randn(size, generator=gen) * INIT_STD).to(torch.bfloat16)


def write_shards(shape: RealShape, out: Path, shard_bytes: int = 2 * GiB, seed: int = 0) -> None:
    """The checkpoint's tensors into safetensors shards of about `shard_bytes`, one shard in memory at a time, and
    model.safetensors.index.json."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    specs = list(tensor_shapes(shape))
    total = sum(torch.Size(s).numel() * 2 for _, s in specs)
    shards, current, size = [], {}, 0
    for name, size_ in specs:
        current[name] = random_tensor(name, size_, gen)
        size += current[name].numel() * 2
        if size >= shard_bytes:
            shards.append(current)
            _save(shards, out, save_file)
            current, size = {}, 0
    if current:
        shards.append(current)
        _save(shards, out, save_file)
    count = len(shards)
    weight_map = {}
    for i in range(count):
        old = out / f"model-{i + 1:05d}.safetensors"
        new = out / f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        old.rename(new)
        weight_map.update({name: new.name for name in shards[i]})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")


def _save(shards: list[dict], out: Path, save_file) -> None:
    """Write the newest shard and drop its tensors, keeping only their names (for the index)."""
    i = len(shards)
    save_file(shards[-1], str(out / f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
    shards[-1] = dict.fromkeys(shards[-1])


def padded_tokenizer(vocab: int):
    """The synthetic corpus's byte-level BPE (vocab 4096), padded to `vocab` with reserved tokens held in the BPE's
    own vocabulary (no merge makes them, so encoding never does). As transformers' added special tokens, 124k of them
    took 73 s to load at every start (transformers' added-token handling), where a real Llama 3 tokenizer adds 256."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from quantkit.calibration.synthetic import build_tokenizer

    tok = build_tokenizer(vocab_size=4096)
    data = json.loads(tok.backend_tokenizer.to_str())
    first = len(tok)
    data["model"]["vocab"].update({f"<|reserved_token_{i}|>": first + i for i in range(vocab - first)})
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token=tok.bos_token,
                                   eos_token=tok.eos_token, pad_token=tok.pad_token, unk_token=None,
                                   model_max_length=tok.model_max_length)


def default_root() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit")) / "real-shapes"


def build(shape: RealShape, out: Path, shard_bytes: int = 2 * GiB) -> Path:
    """The float checkpoint of `shape` at `out`, written once (into a temporary folder, then renamed)."""
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_shards(shape, tmp, shard_bytes)
        (tmp / "config.json").write_text(json.dumps(hf_config(shape), indent=1) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
        padded_tokenizer(shape.vocab).save_pretrained(tmp)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_4bit(float_dir: Path, layout: str, threads: int) -> Path:
    """Its 4-bit RTN checkpoint in `layout` (gptq: symmetric; awq: asymmetric), group 128, beside it; once."""
    from quantkit.bench.runs import quantize_in_child

    out = float_dir.with_name(f"{float_dir.name}-{layout}")
    if not (out / "config.json").is_file():
        sym = ["--sym"] if layout == "gptq" else ["--no-sym"]
        quantize_in_child(float_dir, out, ["--method", "rtn", "--format", layout, "--group-size", "128", *sym],
                          threads)
    return out


def sum_bandwidth(threads: int, gib: float = 2.0, repeats: int = 5, buf: torch.Tensor | None = None) -> float:
    """Bytes read per second (best of `repeats`) by torch's sum over `gib` GiB of fp32 (or `buf`'s bytes as fp32),
    with `threads` torch threads: the first measure of the bound (kernels/stream_read.py says how it compares)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(int(gib * GiB) // 4, dtype=torch.float32) if buf is None else buf.view(torch.float32)
        buf.sum()  # pages touched once before timing
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        return buf.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


BANDWIDTH_LOOPS = {"stream": "the streaming-read kernel (kernels/csrc/stream_read_cpu.cpp)",
                   "sum": "torch's fp32 sum"}


def read_bandwidth(threads: int, gib: float = 2.0, repeats: int = 5, loop: str = "stream") -> float:
    """Bytes read per second (best of `repeats`) over `gib` GiB with `threads` threads, by `loop` (BANDWIDTH_LOOPS;
    "stream" raises RuntimeError where its kernel is not built)."""
    if loop == "sum":
        return sum_bandwidth(threads, gib, repeats)
    from quantkit.kernels.stream_read import stream_read_bandwidth

    return stream_read_bandwidth(threads, gib, repeats)


def _read_buffer(gib: float, huge: bool) -> torch.Tensor:
    """uint8, every page touched, for the read loops: on 4 KiB pages, or on transparent huge pages (RuntimeError
    where THP is unavailable)."""
    from quantkit.engine.huge_pages import huge_page_buffer

    n = int(gib * GiB) // 64 * 64
    return huge_page_buffer(n) if huge else torch.full((n,), 1, dtype=torch.uint8)


def best_read(threads: int, gib: float = 2.0, repeats: int = 2) -> tuple[float, str]:
    """(bytes read per second, by which loop): the fastest reader of this moment, the streaming kernel at each prefetch
    distance and torch's sum, each on 4 KiB pages and (where THP is available) on huge pages, as the engine holds its
    weights: the bound a decode's rate is held against (the sum alone where the kernel is not built)."""
    from quantkit.engine.huge_pages import thp_unavailable
    from quantkit.kernels.stream_read import stream_read_rates, unavailable

    rates = {}
    for pages in ("4 KiB pages", "huge pages"):
        if pages == "huge pages" and thp_unavailable() is not None:
            continue
        buf = _read_buffer(gib, pages == "huge pages")  # one buffer for every loop of this kind of page
        rates[f"torch's sum, {pages}"] = sum_bandwidth(threads, gib, repeats, buf)
        if unavailable() is None:
            for ahead, rate in stream_read_rates(threads, gib, repeats, buf=buf).items():
                rates[f"stream kernel {f'{ahead // 1024} KiB ahead' if ahead else 'no prefetch'}, {pages}"] = rate
        del buf
    name = max(rates, key=rates.get)
    return rates[name], name


def _rate(loop: str, threads: int, gib: float, repeats: int, huge: bool) -> str:
    """One loop's rate, one line: the streaming kernel's at its best prefetch distance, with every distance's; on
    4 KiB pages or, `huge`, on transparent huge pages (RuntimeError where THP is unavailable)."""
    buf = _read_buffer(gib, huge)
    if loop != "stream":
        return f"{sum_bandwidth(threads, gib, repeats, buf) / 1e9:.1f} GB/s"
    from quantkit.kernels.stream_read import stream_read_rates

    rates = stream_read_rates(threads, gib, repeats, buf=buf)
    each = ", ".join(f"{a // 1024} KiB ahead {r / 1e9:.1f}" if a else f"none {r / 1e9:.1f}" for a, r in rates.items())
    return f"{max(rates.values()) / 1e9:.1f} GB/s (prefetch {each})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write a float checkpoint of a real shape (and its 4-bit ones)")
    b.add_argument("shape", choices=sorted(SHAPES))
    b.add_argument("--layers", type=int, default=None, help="only this many decoder layers (default: the shape's)")
    b.add_argument("--out", type=Path, default=None)
    b.add_argument("--gptq", action="store_true")
    b.add_argument("--awq", action="store_true")
    b.add_argument("--threads", type=int, default=2)
    w = sub.add_parser("bandwidth", help="memory read bandwidth")
    w.add_argument("--threads", type=int, default=2)
    w.add_argument("--gib", type=float, default=2.0)
    w.add_argument("--loop", choices=sorted(BANDWIDTH_LOOPS), action="append",
                   help="which read loop (default: both)")
    w.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.command == "bandwidth":
        for huge in (False, True):
            for loop in args.loop or list(BANDWIDTH_LOOPS):
                try:
                    rate = _rate(loop, args.threads, args.gib, args.repeats, huge)
                except RuntimeError as e:
                    rate = f"not measured ({e})"
                print(f"read bandwidth, {args.threads} threads, {args.gib:g} GiB buffer in "
                      f"{'huge' if huge else '4 KiB'} pages, best of {args.repeats}, {BANDWIDTH_LOOPS[loop]}: {rate}",
                      flush=True)
        return
    shape = with_layers(SHAPES[args.shape], args.layers)
    start = time.perf_counter()
    out = build(shape, args.out or default_root() / shape.name)
    print(f"{shape.name}: {num_parameters(shape) / 1e9:.2f} B parameters at {out} ({time.perf_counter() - start:.0f} s)")
    for layout in [x for x, on in (("gptq", args.gptq), ("awq", args.awq)) if on]:
        start = time.perf_counter()
        print(f"{layout}: {build_4bit(out, layout, args.threads)} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
