"""4-bit MoE decode on the engine: Qwen3-30B-A3B's layer shape, random weights, a few layers.

  python benchmarks/moe_decode.py [--layers 4] [--vocab 32000] [--threads 2] [--batches 1,8] [--rounds 3]

The model: Qwen3-30B-A3B's config (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of 768, top 8, q/k
norms) with `--layers` layers and a `--vocab` vocabulary (the real 151,936 would make lm_head most of a few-layer
model's bytes), random bf16 weights written expert by expert under the checkpoint's names, then quantized by
quantkit's pipeline (RTN, 4 bits, group 128, GPTQ layout: no calibration needed for a speed figure). The engine
runs it in bf16; decode speed per batch size is steady-state: (generated tokens) / (time of a long run - time of
a short one), so prefill and start-up cancel. Printed with the bytes one decode token reads of the packed weights
(attention, the top-k experts of each layer, the router and lm_head).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)


def write_random_model(out: Path, layers: int, vocab: int, seed: int = 0) -> Path:
    """A random bf16 Qwen3-MoE checkpoint of Qwen3-30B-A3B's layer shape, written one tensor at a time."""
    from transformers import Qwen3MoeConfig

    from quantkit.calibration.synthetic import build_tokenizer
    from quantkit.format.arch import config_dims, spec_for
    from quantkit.quant.writer import ShardWriter

    config = Qwen3MoeConfig(num_hidden_layers=layers, vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0, **QWEN3_30B_A3B)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(out)
    build_tokenizer(vocab_size=512).save_pretrained(out)
    spec, dims = spec_for(config), config_dims(config)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    h, d = config.hidden_size, config.head_dim
    writer = ShardWriter(out, 2 << 30)
    writer.add({"model.embed_tokens.weight": randn(vocab, h), "lm_head.weight": randn(vocab, h),
                "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for i in range(layers):
        p = f"model.layers.{i}."
        ones = {n: torch.ones(h, dtype=torch.bfloat16) for n in ("input_layernorm", "post_attention_layernorm")}
        writer.add({f"{p}{n}.weight": t for n, t in ones.items()})
        writer.add({f"{p}self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                    f"{p}self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                    f"{p}{spec.experts.router_path}.weight": randn(config.num_experts, h)})
        for name in spec.layer_linears(config):
            n, k = (dims[x] for x in spec.dims_of(name))
            writer.add({f"{p}{name}.weight": randn(n, k)})
    writer.finish()
    return out


def quantize_rtn(model: Path, out: Path) -> Path:
    from quantkit.config import QuantizeConfig
    from quantkit.quant.pipeline import quantize_model

    out.mkdir()
    quantize_model(QuantizeConfig(model=str(model), out=out, method="rtn", group_size=128, device="cpu"), out,
                   show_progress=False)
    return out


def decode_rate(llm, batch: int, short: int = 8, long: int = 72, rounds: int = 3) -> float:
    """Steady decode tokens/s at `batch` sequences: best of `rounds` of (long - short) * batch / (t_long - t_short)."""
    from quantkit.engine import SamplingParams

    prompts = [[1] + list(range(3 + i, 35 + i)) for i in range(batch)]

    def timed(tokens: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - t0

    timed(short)  # warm-up
    rates = []
    for _ in range(rounds):
        rates.append((long - short) * batch / (timed(long) - timed(short)))
    return max(rates)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="Write the models here and keep them (default: a "
                    "temporary folder).")
    args = ap.parse_args()
    from quantkit.engine import LLM

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        qdir = root / "q4"
        if not qdir.exists():
            qdir = quantize_rtn(write_random_model(root / "bf16", args.layers, args.vocab), qdir)
        llm = LLM(str(qdir), dtype="bfloat16", max_model_len=256, max_num_seqs=16, num_threads=args.threads)
        mib = token_bytes(llm) / 2**20
        print(f"Qwen3-30B-A3B layer shape, {args.layers} layers, vocab {args.vocab}, 4-bit RTN g128, bf16, "
              f"{args.threads} threads; {mib:.1f} MiB of weights read per decode token")
        print("| batch | decode tokens/s |\n|---|---|")
        for b in (int(x) for x in args.batches.split(",")):
            print(f"| {b} | {decode_rate(llm, b, rounds=args.rounds):.1f} |", flush=True)


if __name__ == "__main__":
    main()
