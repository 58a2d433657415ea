"""A float Hugging Face model written as a GGUF file that llama.cpp loads (F32 or F16), with the `gguf` package.

llama-cpp-python's wheel does not ship llama.cpp's HF converter, so the benchmarks against llama.cpp
write the file themselves. What differs between architectures is data (`GGUF_ARCHS`, one row per HF
architecture); the writing is one path. What makes the file llama.cpp's:
  * tensor names: `gguf`'s own HF-to-GGUF name table for the row's architecture
    (`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`);
  * experts (an MoE row): each layer's per-expert linears stacked into one 3-D tensor per role, as
    llama.cpp reads them (`mlp.experts.<e>.gate_proj` [I, H] x E -> `blk.N.ffn_gate_exps` [E, I, H]);
    the float router is `ffn_gate_inp`;
  * rotary convention: HF rotates the pairs (i, i + d/2) of each head. llama.cpp's `llama` architecture
    rotates (2i, 2i + 1): there the rows of q_proj and k_proj are reordered per head so that both compute
    the same attention (`rope_rows_to_interleaved`); its Qwen architectures rotate HF's pairs (NEOX), so
    their rows stay;
  * metadata: the architecture's hyper-parameters (the experts' count, top-k and width for an MoE row),
    and a placeholder SentencePiece vocabulary of the model's vocabulary size (the benchmarks feed token
    ids; the HF tokenizer never runs on either side).
GGUF lists a tensor's dimensions innermost first, so a torch weight [out, in] is stored as ne = (in, out);
the writer does that from the numpy shape.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Iterable, Iterator

import torch

from quantkit.engine.decoder import DecoderShape
from quantkit.format.arch import ExpertsSpec
from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class GGUFArch:
    """How one HF architecture is written for llama.cpp."""

    name: str  # llama.cpp's architecture (general.architecture, the metadata keys' prefix)
    model_arch: str  # its member of gguf.MODEL_ARCH (the tensor name table)
    interleave_rope: dict[str, str]  # linears whose rows take the rotary reordering -> the DecoderShape field
    # with their head count ({} where llama.cpp rotates HF's pairs)
    experts: bool = False  # per-expert linears stacked, with the experts' metadata


GGUF_ARCHS = {
    "LlamaForCausalLM": GGUFArch("llama", "LLAMA", {"self_attn.q_proj": "num_heads", "self_attn.k_proj": "num_kv_heads"}),
    "Qwen3MoeForCausalLM": GGUFArch("qwen3moe", "QWEN3MOE", {}, experts=True),
}
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


def gguf_name(hf_name: str, num_layers: int, model_arch: str = "LLAMA") -> str:
    """llama.cpp's name of an HF tensor, from the `gguf` package's name table of `model_arch` (a gguf.MODEL_ARCH
    member's name)."""
    import gguf

    name = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, model_arch), num_layers).get_name(
        hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise QuantkitError(f"no GGUF name for tensor {hf_name!r}")
    return name


LAYER_TENSOR = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.(?P<linear>.+)\.weight$")


def expert_slot(hf_name: str, experts: ExpertsSpec) -> tuple[str, int] | None:
    """(the stacked tensor's HF name, expert index) of one expert's linear; None for any other tensor.

    'model.layers.3.mlp.experts.5.gate_proj.weight' -> ('model.layers.3.mlp.experts.gate_proj.weight', 5): the
    name llama.cpp's converter gives the stack, which the `gguf` name table maps to `blk.3.ffn_gate_exps`.
    """
    m = LAYER_TENSOR.match(hf_name)
    parsed = experts.parse(m["linear"]) if m else None
    if parsed is None:
        return None
    e, role = parsed
    return f"{m['layer']}.{experts.block}.{experts.experts}.{getattr(experts, role)}.weight", e


def gguf_tensors(tensors: Iterable[tuple[str, torch.Tensor]], arch: GGUFArch, shape: DecoderShape,
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors -> (gguf name, tensor in `dtype`), with the rotary reordering and the experts' stacking.

    Each expert's linear is cast as it comes; a stack [experts, out, in] is yielded once its last expert has come.
    Norm weights stay F32 (llama.cpp computes norms in F32 and its quantizer leaves 1-D tensors alone).
    """
    pending: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for hf_name, t in tensors:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by llama.cpp from rope_theta
        slot = expert_slot(hf_name, shape.experts) if arch.experts and shape.experts else None
        if slot is not None:
            stacked, e = slot
            pending[stacked][e] = t.to(dtype)
            if len(pending[stacked]) == shape.moe.num_experts:
                parts = pending.pop(stacked)
                yield gguf_name(stacked, shape.num_layers, arch.model_arch), torch.stack(
                    [parts[i] for i in range(shape.moe.num_experts)])
            continue
        heads = next((getattr(shape, key) for part, key in arch.interleave_rope.items() if f".{part}." in hf_name),
                     None)
        if heads is not None:
            t = rope_rows_to_interleaved(t, heads)
        yield gguf_name(hf_name, shape.num_layers, arch.model_arch), t.to(torch.float32 if t.dim() == 1 else dtype)
    if pending:
        raise QuantkitError(f"experts missing from the checkpoint: {', '.join(sorted(pending))} "
                            f"(of {shape.moe.num_experts} each)")


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


def _write_experts(writer, shape: DecoderShape) -> None:
    """An MoE row's keys: llama.cpp sizes the stacked expert tensors and its top-k from them."""
    writer.add_expert_count(shape.moe.num_experts)
    writer.add_expert_used_count(shape.moe.top_k)
    writer.add_expert_feed_forward_length(shape.moe.intermediate)


def _write_metadata(writer, shape: DecoderShape, config, file_type: int, name: str, arch: GGUFArch) -> None:
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
    if arch.experts:
        _write_experts(writer, shape)
    tokens, scores, types = placeholder_vocab(shape.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(config.bos_token_id if config.bos_token_id is not None else 1)
    writer.add_eos_token_id(config.eos_token_id if config.eos_token_id is not None else 2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)  # prompts are token ids, fed as they are


def read_float_checkpoint(model_dir: Path) -> tuple[GGUFArch, list[Path]]:
    """(the GGUF row of its HF architecture, its safetensors files) of a float HF checkpoint."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in GGUF_ARCHS:
        raise QuantkitError(f"{model_dir}: architecture {arch} is not written to GGUF here "
                            f"(supported: {', '.join(GGUF_ARCHS)})")
    if "quantization_config" in config:
        raise QuantkitError(f"{model_dir} is a quantized checkpoint; GGUF is written from the float model")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise QuantkitError(f"{model_dir}: no *.safetensors files")
    return GGUF_ARCHS[arch], files


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def read_tensors(files: list[Path], meta: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the files, read when asked for (a model is never whole in memory); with `meta`, tensors of
    the same shapes and dtypes on the meta device, read from the headers only."""
    from safetensors import safe_open

    for f in files:
        with safe_open(f, framework="pt") as reader:
            for name in reader.keys():
                if meta:
                    part = reader.get_slice(name)
                    yield name, torch.empty(part.get_shape(), dtype=SAFETENSORS_DTYPES[part.get_dtype()], device="meta")
                else:
                    yield name, reader.get_tensor(name)


def write_gguf(model_dir: Path, out: Path, file_type: str = "f32") -> Path:
    """Write `model_dir` (a float HF model of a `GGUF_ARCHS` architecture) to `out` as a GGUF of `file_type`
    (f32 or f16).

    Streamed: the tensors' names, shapes and types first (computed on the meta device), then each tensor's data as
    it is converted, so that memory holds one layer's experts at most. Written to a temporary name beside `out`,
    then renamed: a failure leaves no half-written file.
    """
    import gguf
    import numpy as np

    from transformers import AutoConfig

    dtype, ftype = FILE_TYPES[file_type]
    arch, files = read_float_checkpoint(Path(model_dir))
    config = AutoConfig.from_pretrained(model_dir)
    shape = DecoderShape.from_config(config)
    factors = rope_freq_factors(shape)
    extra = [("rope_freqs.weight", factors)] if factors is not None else []
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, arch.name)
    try:
        _write_metadata(writer, shape, config, ftype, Path(model_dir).name, arch)
        for name, t in [*gguf_tensors(read_tensors(files, meta=True), arch, shape, dtype), *extra]:
            np_dtype = np.dtype(str(t.dtype).removeprefix("torch."))
            writer.add_tensor_info(name, tuple(t.shape), np_dtype, t.numel() * np_dtype.itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, t in chain(gguf_tensors(read_tensors(files), arch, shape, dtype), extra):  # one at a time
            writer.write_tensor_data(t.contiguous().numpy())
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return out


def gguf_read_per_token(path: Path) -> int:
    """Bytes a batch-1 decode token of a GGUF model reads: every tensor but the token embedding, of which it reads one
    row, unless the model has no `output.weight` (the embedding is then the output layer, read whole)."""
    import gguf

    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    return sum(sizes.values()) - (sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0)
