"""The HF-to-GGUF writer of the llama.cpp benchmark: the rotary reordering against both rotary
conventions, the tensor names, and a written file read back with gguf's own reader."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install gguf) writes and reads GGUF")

from quantkit.bench.gguf_export import (  # noqa: E402
    gguf_name,
    placeholder_vocab,
    rope_rows_to_interleaved,
    write_gguf,
)
from quantkit.errors import QuantkitError  # noqa: E402

BASE = 10000.0


def hf_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """transformers' Llama rotary (pairs (i, i + d/2)). x: [T, heads, d]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    d = x.shape[-1]
    inv = BASE ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = positions[:, None].double() * inv  # [T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[None]  # [1, T, d]
    q = x.transpose(0, 1)[None]  # [1, heads, T, d]
    out, _ = apply_rotary_pos_emb(q, q, emb.cos(), emb.sin())
    return out[0].transpose(0, 1)


def llamacpp_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """llama.cpp's rotary for the `llama` architecture (ggml rope, normal mode): pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    theta = positions[:, None, None].double() * BASE ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * theta.cos() - x1 * theta.sin()
    out[..., 1::2] = x0 * theta.sin() + x1 * theta.cos()
    return out


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 8), (16, 8, 64), (2, 2, 32)])
def test_reordered_rows_give_the_same_attention_under_llamacpp_rope(heads, kv_heads, d):
    g = torch.Generator().manual_seed(0)
    hidden, t = 48, 7
    x = torch.randn(t, hidden, generator=g, dtype=torch.float64)
    wq = torch.randn(heads * d, hidden, generator=g, dtype=torch.float64)
    wk = torch.randn(kv_heads * d, hidden, generator=g, dtype=torch.float64)
    pos = torch.arange(3, 3 + t)

    def scores(q, k):  # [heads, T, T], GQA: each kv head serves heads / kv_heads query heads
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        return torch.einsum("thd,shd->hts", q, k)

    q_hf = hf_rope((x @ wq.T).view(t, heads, d), pos)
    k_hf = hf_rope((x @ wk.T).view(t, kv_heads, d), pos)
    q_cpp = llamacpp_rope((x @ rope_rows_to_interleaved(wq, heads).T).view(t, heads, d), pos)
    k_cpp = llamacpp_rope((x @ rope_rows_to_interleaved(wk, kv_heads).T).view(t, kv_heads, d), pos)
    torch.testing.assert_close(scores(q_cpp, k_cpp), scores(q_hf, k_hf))
    # the rotated queries themselves are HF's, with each head's features in llama.cpp's order
    torch.testing.assert_close(q_cpp.reshape(t, -1), rope_rows_to_interleaved(q_hf.reshape(t, -1).T, heads).T)
    # without the reordering llama.cpp's rotary computes something else
    q_raw = llamacpp_rope((x @ wq.T).view(t, heads, d), pos)
    k_raw = llamacpp_rope((x @ wk.T).view(t, kv_heads, d), pos)
    assert not torch.allclose(scores(q_raw, k_raw), scores(q_hf, k_hf))


def test_reordering_moves_row_half_i_to_2i_plus_half_and_takes_biases():
    w = torch.arange(2 * 8).float()  # 2 heads of 8: a bias, or a weight's row indices
    assert rope_rows_to_interleaved(w, 2).tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    with pytest.raises(ValueError, match="heads of even size"):
        rope_rows_to_interleaved(torch.zeros(12, 3), 4)


def test_hf_llama_names_map_to_llamacpp_names():
    expected = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    expected |= {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{cpp}.weight" for i in (0, 7) for hf, cpp in parts.items()}
    assert {name: gguf_name(name, 8) for name in expected} == expected
    with pytest.raises(QuantkitError, match="no GGUF name"):
        gguf_name("model.layers.0.mystery.weight", 8)


def test_placeholder_vocab_has_the_model_size_distinct_tokens_and_byte_pieces():
    tokens, scores, types = placeholder_vocab(1000)
    assert len(tokens) == len(set(tokens)) == len(scores) == len(types) == 1000
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3 + 0x0A] == "<0x0A>"
    assert types[1] == gguf.TokenType.CONTROL and types[3] == gguf.TokenType.BYTE


def field(reader, key: str):
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value[0]


def test_a_decode_token_reads_every_tensor_but_an_untied_embedding(tiny_llama, tmp_path):
    from quantkit.bench.gguf_export import gguf_read_per_token

    out = write_gguf(tiny_llama, tmp_path / "m.gguf", "f32")
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(out).tensors}
    assert "output.weight" in sizes  # the tiny Llama is untied: one row of token_embd a token
    assert gguf_read_per_token(out) == sum(sizes.values()) - sizes["token_embd.weight"]
    from safetensors.torch import load_file

    hf = load_file(tiny_llama / "model.safetensors")  # F32: 4 bytes a parameter
    assert gguf_read_per_token(out) == 4 * sum(t.numel() for k, t in hf.items() if "embed_tokens" not in k)


@pytest.mark.parametrize("file_type,matrix_type", [("f32", "F32"), ("f16", "F16")])
def test_written_gguf_reads_back_with_llamas_metadata_and_reordered_weights(tiny_llama, tmp_path, file_type,
                                                                            matrix_type):
    from safetensors.torch import load_file

    out = write_gguf(tiny_llama, tmp_path / "m.gguf", file_type)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
    cfg = json.loads((tiny_llama / "config.json").read_text())
    r = gguf.GGUFReader(out)
    assert field(r, "general.architecture") == "llama"
    meta = {k: int(field(r, f"llama.{k}")) for k in ("block_count", "embedding_length", "feed_forward_length",
                                                     "attention.head_count", "attention.head_count_kv")}
    assert meta == {"block_count": cfg["num_hidden_layers"], "embedding_length": cfg["hidden_size"],
                    "feed_forward_length": cfg["intermediate_size"],
                    "attention.head_count": cfg["num_attention_heads"],
                    "attention.head_count_kv": cfg["num_key_value_heads"]}
    assert len(r.fields["tokenizer.ggml.tokens"].data) == cfg["vocab_size"]
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 3 + 9 * cfg["num_hidden_layers"]
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == matrix_type
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    hf = load_file(tiny_llama / "model.safetensors")
    for part, heads in (("q", cfg["num_attention_heads"]), ("k", cfg["num_key_value_heads"])):
        want = rope_rows_to_interleaved(hf[f"model.layers.1.self_attn.{part}_proj.weight"], heads)
        got = torch.from_numpy(tensors[f"blk.1.attn_{part}.weight"].data.astype("float32"))
        torch.testing.assert_close(got, want, atol=1e-3 if file_type == "f16" else 0, rtol=1e-3)
    got_v = torch.from_numpy(tensors["blk.1.attn_v.weight"].data.astype("float32"))
    torch.testing.assert_close(got_v, hf["model.layers.1.self_attn.v_proj.weight"], atol=1e-3, rtol=1e-3)


def test_non_llama_or_quantized_checkpoints_are_refused_without_output(tiny_qwen2, tiny_llama, tmp_path):
    with pytest.raises(QuantkitError, match="Qwen2ForCausalLM is not written to GGUF"):
        write_gguf(tiny_qwen2, tmp_path / "q.gguf")
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    cfg = json.loads((tiny_llama / "config.json").read_text()) | {"quantization_config": {"bits": 4}}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantkitError, match="quantized checkpoint"):
        write_gguf(quantized, tmp_path / "x.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quantized"]


def test_a_failed_write_leaves_no_partial_file(tiny_llama, tmp_path, monkeypatch):
    import quantkit.bench.gguf_export as mod

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", boom)
    with pytest.raises(OSError, match="disk full"):
        mod.write_gguf(tiny_llama, tmp_path / "m.gguf")
    assert list(Path(tmp_path).iterdir()) == []


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_llama3_rope_factors_make_llamacpps_frequencies_transformers_own():
    """llama.cpp divides each default RoPE frequency by rope_freqs.weight: the result must be transformers' llama3
    frequencies (computed here by transformers, not by quantkit's engine)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from quantkit.bench.gguf_export import rope_freq_factors
    from quantkit.engine.decoder_shape import DecoderShape

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                         intermediate_size=64, vocab_size=300, max_position_embeddings=512,
                         rope_parameters=dict(LLAMA3_ROPE), architectures=["LlamaForCausalLM"])
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    d = 256 // 4
    plain = 500000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    factors = rope_freq_factors(DecoderShape.from_config(config))
    assert factors.shape == (d // 2,) and factors.dtype == torch.float32
    assert factors.min() >= 1.0 and factors.max() == pytest.approx(8.0)  # short wavelengths kept, long ones / 8
    torch.testing.assert_close(plain / factors.double(), want.double(), rtol=1e-6, atol=0)


def test_a_llama3_rope_model_is_written_with_its_frequency_factors(tmp_path):
    from tests_support.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "m", family="llama")
    cfg = json.loads((model / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = dict(LLAMA3_ROPE)
    (model / "config.json").write_text(json.dumps(cfg))
    out = write_gguf(model, tmp_path / "m.gguf")
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert tuple(tensors["rope_freqs.weight"].data.shape) == (head_dim // 2,)


# Qwen3-MoE: llama.cpp's `qwen3moe` architecture, experts stacked per role


def test_expert_linears_map_to_their_stack_and_other_tensors_do_not():
    from quantkit.bench.gguf_export import expert_slot
    from quantkit.format.arch import ExpertsSpec

    x = ExpertsSpec(block="mlp", hf_attr="mlp", gate="gate_proj", up="up_proj", down="down_proj")
    assert expert_slot("model.layers.3.mlp.experts.5.gate_proj.weight", x) == (
        "model.layers.3.mlp.experts.gate_proj.weight", 5)
    assert expert_slot("model.layers.12.mlp.experts.0.down_proj.weight", x) == (
        "model.layers.12.mlp.experts.down_proj.weight", 0)
    for other in ("model.layers.3.mlp.gate.weight", "model.layers.3.self_attn.q_proj.weight", "lm_head.weight",
                  "model.layers.3.mlp.experts.5.mystery.weight"):
        assert expert_slot(other, x) is None
    assert gguf_name("model.layers.3.mlp.experts.gate_proj.weight", 4, "QWEN3MOE") == "blk.3.ffn_gate_exps.weight"
    assert gguf_name("model.layers.3.mlp.gate.weight", 4, "QWEN3MOE") == "blk.3.ffn_gate_inp.weight"
    assert gguf_name("model.layers.3.self_attn.k_norm.weight", 4, "QWEN3MOE") == "blk.3.attn_k_norm.weight"


def test_a_qwen3_moe_is_written_with_stacked_experts_its_router_and_qk_norms(tiny_family, tmp_path):
    from safetensors.torch import load_file

    model = tiny_family("qwen3_moe")
    cfg = json.loads((model / "config.json").read_text())
    out = write_gguf(model, tmp_path / "moe.gguf", "f16")
    r = gguf.GGUFReader(out)
    assert field(r, "general.architecture") == "qwen3moe"
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    meta = {k: int(field(r, f"qwen3moe.{k}")) for k in ("expert_count", "expert_used_count",
                                                        "expert_feed_forward_length", "attention.head_count_kv")}
    assert meta == {"expert_count": experts, "expert_used_count": cfg["num_experts_per_tok"],
                    "expert_feed_forward_length": cfg["moe_intermediate_size"],
                    "attention.head_count_kv": cfg["num_key_value_heads"]}
    tensors = {t.name: t for t in r.tensors}
    layers, h, i = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    per_layer = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
                 "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
    assert set(tensors) == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{b}.{p}.weight" for b in range(layers) for p in per_layer}
    hf = load_file(model / "model.safetensors")
    gate = torch.from_numpy(tensors["blk.1.ffn_gate_exps.weight"].data.astype("float32"))  # numpy: [E, I, H]
    down = torch.from_numpy(tensors["blk.1.ffn_down_exps.weight"].data.astype("float32"))
    assert tuple(gate.shape) == (experts, i, h) and tuple(down.shape) == (experts, h, i)
    for e in (0, experts - 1):
        torch.testing.assert_close(gate[e], hf[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(down[e], hf[f"model.layers.1.mlp.experts.{e}.down_proj.weight"], atol=1e-3, rtol=1e-3)
    # llama.cpp's qwen3moe rotates HF's (i, i + d/2) pairs: q's rows are written as they are
    q = torch.from_numpy(tensors["blk.0.attn_q.weight"].data.astype("float32"))
    torch.testing.assert_close(q, hf["model.layers.0.self_attn.q_proj.weight"], atol=1e-3, rtol=1e-3)
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F16"
    assert tensors["blk.0.attn_q_norm.weight"].tensor_type.name == "F32"


def test_a_checkpoint_missing_an_expert_is_refused_without_output(tiny_family, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_family("qwen3_moe")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((src / "config.json").read_text())
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(state, broken / "model.safetensors")
    with pytest.raises(QuantkitError, match=r"experts missing.*layers\.1\.mlp\.experts\.up_proj"):
        write_gguf(broken, tmp_path / "x.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


LLAMACPP_VENV = Path(os.environ.get("QUANTKIT_LLAMACPP_VENV", Path(__file__).resolve().parents[3] / ".venvs" / "llamacpp"))


@pytest.mark.interop
@pytest.mark.slow
def test_llamacpp_computes_transformers_logits_on_the_written_qwen3_moe(tiny_family, tmp_path):
    """The F32 GGUF in llama.cpp (llama-cpp-python's venv, QUANTKIT_LLAMACPP_VENV) against transformers' fp32
    forward: the logits after a prompt, for every expert's routing to count (8 experts, top 2, 12 tokens)."""
    if not (LLAMACPP_VENV / "bin" / "python").exists():
        pytest.skip(f"no llama-cpp-python venv at {LLAMACPP_VENV} (set QUANTKIT_LLAMACPP_VENV): python3 -m venv VENV "
                    "&& VENV/bin/pip install llama-cpp-python==0.3.36 gguf")
    from quantkit.bench.vs_llamacpp import LlamaCpp, transformers_logits

    model = tiny_family("qwen3_moe")
    out = write_gguf(model, tmp_path / "moe.gguf", "f32")
    prompt = [5, 77, 301, 12, 9, 480, 33, 150, 7, 260, 91, 44]
    peer = LlamaCpp(LLAMACPP_VENV / "bin" / "python", {"F32": out}, threads=2, log=tmp_path / "llamacpp.log")
    try:
        theirs = peer.run("F32", prompt, 1, logits=True)
    finally:
        peer.close()
    ref = transformers_logits(model, prompt)
    got = torch.tensor(theirs.first_logits)
    assert got.shape == ref.shape
    # llama.cpp keeps its KV cache in F16; a wrong expert order, routing or rotary gives O(1) differences
    assert (got - ref).abs().max().item() < 2e-2 * ref.std().item(), ((got - ref).abs().max(), ref.std())
    assert int(got.argmax()) == int(ref.argmax())
