"""A random gpt-oss of gpt-oss-20b's layer shape, as OpenAI ships it (MXFP4 experts) or in bf16, for quantize's memory
and time at a real MoE shape.

  python benchmarks/gpt_oss_shape.py OUT [--layers 2] [--vocab 8192] [--bf16]

gpt-oss-20b's config (hidden 2880, 64 heads / 8 KV heads of 64, 32 experts of 2880, top 4, sliding window 128 on
every other layer, YaRN) with `--layers` layers and a `--vocab` vocabulary (the real 201,088 would make the
embeddings most of a few-layer model), random weights (std 0.02; the experts' stacked gate_up [E, H, 2I] and down
[E, I, H] with biases), the experts encoded to MXFP4 as OpenAI's checkpoints hold them (quantkit.format.mxfp4.encode;
`--bf16`: kept bf16). The tokenizer is real_shapes' BPE padded to the vocabulary. Then, for instance:

  /usr/bin/time -v quantkit quantize OUT --method gptq -o Q --threads 1 --group-size 32 \\
      --calib ../shared/data/wikitext2/test.txt --nsamples 16 --seqlen 512

(gpt-oss's 2880 columns are not a multiple of 128: groups of 32 or 64.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                   max_position_embeddings=131072, tie_word_embeddings=False)


def write(out: Path, layers: int, vocab: int, mxfp4: bool, seed: int = 0) -> None:
    from safetensors.torch import save_file
    from transformers import GptOssConfig

    from quantkit.bench.real_shapes import padded_tokenizer
    from quantkit.format import mxfp4 as fmt

    config = GptOssConfig(num_hidden_layers=layers, vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                          layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                          **GPT_OSS_20B)
    config.architectures = ["GptOssForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    if mxfp4:
        data = json.loads((out / "config.json").read_text())
        data["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (out / "config.json").write_text(json.dumps(data, indent=2))
    padded_tokenizer(vocab).save_pretrained(out)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    h, e, i, d = config.hidden_size, config.num_local_experts, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    head = {"model.embed_tokens.weight": randn(vocab, h), "lm_head.weight": randn(vocab, h),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    save_file(head, str(out / "model-head.safetensors"), metadata={"format": "pt"})
    index = {k: "model-head.safetensors" for k in head}
    for layer in range(layers):  # one shard a layer: the writer holds one layer's tensors at a time
        p = f"model.layers.{layer}"
        t = {f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             f"{p}.self_attn.sinks": randn(config.num_attention_heads) * 50,
             f"{p}.mlp.router.weight": randn(e, h), f"{p}.mlp.router.bias": randn(e)}
        for name, (n, k) in {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}.items():
            t[f"{p}.self_attn.{name}.weight"], t[f"{p}.self_attn.{name}.bias"] = randn(n, k), randn(n)
        for name, (k, n) in {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}.items():
            stacked = randn(e, k, n)  # [E, in, out]
            t[f"{p}.mlp.experts.{name}_bias"] = randn(e, n)
            if mxfp4:
                t[f"{p}.mlp.experts.{name}_blocks"], t[f"{p}.mlp.experts.{name}_scales"] = fmt.encode_stacked(stacked)
            else:
                t[f"{p}.mlp.experts.{name}"] = stacked
        shard = f"model-layer{layer}.safetensors"
        save_file(t, str(out / shard), metadata={"format": "pt"})
        index |= {k: shard for k in t}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--bf16", action="store_true", help="keep the experts bf16 (default: MXFP4, as OpenAI ships them)")
    args = ap.parse_args()
    write(args.out, args.layers, args.vocab, not args.bf16)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
