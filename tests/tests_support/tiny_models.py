"""Tiny random models saved with save_pretrained, for shapes the real shared model lacks.

Shapes are chosen so every linear packs at group size 32/64/128 (hidden 128, intermediate 256),
with GQA (4 heads, 2 kv heads) like the real families. The tokenizer is the project's own
synthetic-corpus BPE, so no download is needed.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    # a sliding layer (window 24: the test prompts run past it) then a full one, each with its own RoPE base;
    # the final logits soft-capped; query_pre_attn_scalar apart from head_dim
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 32, "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 5.0, "query_pre_attn_scalar": 24}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "norm_topk_prob": True}),
    # experts stacked in the checkpoint, gate/up interleaved, biases everywhere, attention sinks, YaRN, a sliding
    # layer (window 24) then a full one
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention"]}),
}
STACKED_EXPERTS = ("gpt_oss",)  # families whose experts are 3-D parameters, widened like the linears


def make_tiny_model(out: Path, family: str = "llama", hidden: int = 128, intermediate: int = 256,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 512,
                    max_positions: int = 512, seed: int = 0, tie: bool = False) -> Path:
    import transformers

    from quantkit.calibration.synthetic import build_tokenizer

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra,
    )
    model = getattr(transformers, model_name)(config).to(torch.float32)
    # Random init gives near-uniform logits; widen the weights so outputs depend on the input.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or (p.dim() == 3 and family in STACKED_EXPERTS):
                p.normal_(0, 0.08)
            elif "bias" in name:
                p.normal_(0, 0.02)
            elif name.endswith("sinks"):  # a logit per head, of the scores' size, so that it matters
                p.normal_(0, 1.0)
    model.save_pretrained(out)
    build_tokenizer(vocab_size=vocab).save_pretrained(out)
    return Path(out)


def with_metaspace_tokenizer(src: Path, out: Path) -> Path:
    """`src` (a Llama checkpoint with a SentencePiece tokenizer.json, such as stories260K's, whose normalizer adds
    the "▁" markers: the legacy way) as a checkpoint whose tokenizer marks spaces with a Metaspace pre-tokenizer
    instead, as Llama 2's and Mistral's tokenizer.json files do. Same vocabulary and ids; the weights and config
    are links to `src`'s, not copies."""
    import json
    import shutil

    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix in (".safetensors", ".json") and f.name not in ("tokenizer.json", "tokenizer_config.json"):
            (out / f.name).symlink_to(f.resolve())
    tok = json.loads((src / "tokenizer.json").read_text())
    tok["normalizer"] = None
    tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "legacy": False}))
    shutil.copymode(src / "tokenizer.json", out / "tokenizer.json")
    return out
