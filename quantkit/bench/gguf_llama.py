"""A float Hugging Face Llama written as a GGUF file that llama.cpp loads (F32 or F16), with the `gguf` package.

llama-cpp-python's wheel does not ship llama.cpp's HF converter, so the benchmark against llama.cpp
writes the file itself. Three things make the file llama.cpp's:
  * tensor names: `gguf`'s own HF-to-GGUF name table (`model.layers.3.self_attn.q_proj.weight` ->
    `blk.3.attn_q.weight`);
  * rotary convention: HF Llama rotates the pairs (i, i + d/2) of each head, llama.cpp's `llama`
    architecture rotates (2i, 2i + 1); the rows of q_proj and k_proj are reordered per head so that
    both compute the same attention (`rope_rows_to_interleaved`);
  * metadata: the architecture's hyper-parameters, and a placeholder SentencePiece vocabulary of the
    model's vocabulary size (the benchmark feeds token ids; the HF tokenizer never runs on either side).
GGUF lists a tensor's dimensions innermost first, so a torch weight [out, in] is stored as ne = (in, out);
the writer does that from the numpy shape.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from quantkit.engine.decoder import DecoderShape
from quantkit.errors import QuantkitError

# HF architecture name -> (gguf architecture, the tensors whose rows take the rotary reordering,
# and the DecoderShape field with their head count)
ARCHS = {"LlamaForCausalLM": ("llama", {"self_attn.q_proj": "num_heads", "self_attn.k_proj": "num_kv_heads"})}
FILE_TYPES = {"f32": (torch.float32, 0), "f16": (torch.float16, 1)}  # gguf LlamaFileType ALL_F32, MOSTLY_F16
PLACEHOLDER_SPECIALS = ("<unk>", "<s>", "</s>")


def rope_rows_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection from HF's rotate-half pairs to llama.cpp's adjacent pairs.

    w: [n_heads * d, ...] (a weight [n_heads * d, in] or a bias [n_heads * d]). In each head, row
    half * d/2 + i (i < d/2, half in {0, 1}) moves to row 2i + half, so the pair (i, i + d/2) that HF
    rotates together becomes the pair (2i, 2i + 1) that llama.cpp rotates, with the same frequency i.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    d = rows // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_name(hf_name: str, num_layers: int) -> str:
    """llama.cpp's name of an HF Llama tensor, from the `gguf` package's name table."""
    import gguf

    name = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers).get_name(
        hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise QuantkitError(f"no GGUF name for tensor {hf_name!r}")
    return name


def gguf_tensors(state: dict[str, torch.Tensor], arch: str, shape: DecoderShape,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF state dict -> {gguf name: tensor in `dtype`} with the rotary reordering applied.

    Norm weights stay F32 (llama.cpp computes norms in F32 and its quantizer leaves 1-D tensors alone).
    """
    _, permuted = ARCHS[arch]
    out = {}
    for hf_name, t in state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by llama.cpp from rope_theta
        heads = next((getattr(shape, key) for part, key in permuted.items() if f".{part}." in hf_name), None)
        if heads is not None:
            t = rope_rows_to_interleaved(t, heads)
        out[gguf_name(hf_name, shape.num_layers)] = t.to(torch.float32 if t.dim() == 1 else dtype)
    return out


def placeholder_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens
    llama.cpp looks up, then distinct filler pieces up to `size`."""
    import gguf

    specials = list(PLACEHOLDER_SPECIALS)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    fill = [f"\u2581t{i}" for i in range(max(0, size - len(specials) - len(byte_tokens)))]
    tokens = (specials + byte_tokens + fill)[:size]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(fill))[:size]
    return tokens, [0.0] * 3 + [-float(i) for i in range(size - 3)], [int(t) for t in types]


GGUF_ROPE_TYPES = ("default", "llama3")  # llama3: the frequencies' divisors as the tensor rope_freqs.weight


def rope_freq_factors(shape: DecoderShape) -> torch.Tensor | None:
    """llama.cpp's `rope_freqs.weight` for a Llama 3.1-style RoPE: each frequency's divisor (the default RoPE's
    inverse frequency over the scaled one), which llama.cpp applies in its RoPE; None for the default RoPE."""
    from quantkit.engine.rope import inv_frequencies

    if shape.rope["rope_type"] == "default":
        return None
    scaled = inv_frequencies(shape.rope, shape.head_dim, shape.max_position_embeddings)
    plain = inv_frequencies({**shape.rope, "rope_type": "default"}, shape.head_dim, shape.max_position_embeddings)
    return (plain / scaled).to(torch.float32)


def _write_metadata(writer, shape: DecoderShape, config, file_type: int, name: str) -> None:
    if shape.rope["rope_type"] not in GGUF_ROPE_TYPES:
        raise QuantkitError(f"RoPE type {shape.rope['rope_type']!r} is not written to GGUF here "
                            f"(only {', '.join(GGUF_ROPE_TYPES)})")
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_block_count(shape.num_layers)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.head_dim * shape.num_heads != shape.hidden_size:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(float(shape.rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    tokens, scores, types = placeholder_vocab(shape.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(config.bos_token_id if config.bos_token_id is not None else 1)
    writer.add_eos_token_id(config.eos_token_id if config.eos_token_id is not None else 2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)  # prompts are token ids, fed as they are


def read_float_checkpoint(model_dir: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """(HF architecture name, state dict) of a float HF checkpoint in safetensors."""
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in ARCHS:
        raise QuantkitError(f"{model_dir}: architecture {arch} is not written to GGUF here "
                            f"(supported: {', '.join(ARCHS)})")
    if "quantization_config" in config:
        raise QuantkitError(f"{model_dir} is a quantized checkpoint; GGUF is written from the float model")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise QuantkitError(f"{model_dir}: no *.safetensors files")
    state = {}
    for f in files:
        state.update(load_file(f))
    return arch, state


def write_gguf(model_dir: Path, out: Path, file_type: str = "f32") -> Path:
    """Write `model_dir` (a float HF Llama) to `out` as a GGUF of `file_type` (f32 or f16).

    Written to a temporary name beside `out`, then renamed: a failure leaves no half-written file.
    """
    import gguf

    from transformers import AutoConfig

    dtype, ftype = FILE_TYPES[file_type]
    arch, state = read_float_checkpoint(Path(model_dir))
    config = AutoConfig.from_pretrained(model_dir)
    shape = DecoderShape.from_config(config)
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, ARCHS[arch][0])
    try:
        _write_metadata(writer, shape, config, ftype, Path(model_dir).name)
        tensors = gguf_tensors(state, arch, shape, dtype)
        if (factors := rope_freq_factors(shape)) is not None:
            tensors["rope_freqs.weight"] = factors
        for name, t in tensors.items():
            writer.add_tensor(name, t.contiguous().numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return out
