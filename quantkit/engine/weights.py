"""Build the engine's decoder and load a float or quantized checkpoint into it.

Float tensors load by name from the safetensors shards. A linear with packed weights in the shards
(GPTQ v1/v2, AWQ GEMM or compressed-tensors pack-quantized, as `config.json["quantization_config"]`
says) becomes a `QuantLinear`, exactly as quantkit's transformers loader does it; on CPU it is then
repacked for quantkit's 4-bit kernel (torch's int4/int8 kernels where it does not build) and its
checkpoint tensors dropped. On CPU the embedding table is read in place from the checkpoint file
(`MappedEmbedding`: a lookup touches only its rows' pages) wherever lm_head does not share it, and a float
lm_head can be held in int8 (`Int8Linear`, opt-in). The weight memory is logged at load.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch

from quantkit.engine.decoder import Decoder, DecoderShape, RMSNorm, rope_buffer
from quantkit.engine.rope import inv_frequencies
from quantkit.errors import QuantkitError
from quantkit.model.loader import QuantInfo, replace_packed_linears
from quantkit.model.quant_linear import QuantLinear
from quantkit.model.source import ModelSource
from quantkit.format.arch import get_submodule
from quantkit.kernels.int8_cpu import Int8Linear, int8_head_unavailable

log = logging.getLogger("quantkit.engine")
EMBED = "model.embed_tokens.weight"


def load_decoder(source: ModelSource, dtype: torch.dtype, device: torch.device, int8_activations: bool = False,
                 int8_lm_head: bool | None = None, int8_prefill: bool | None = None) -> tuple[Decoder, QuantInfo | None]:
    """The decoder with every weight of the checkpoint `source` loaded, in eval mode on `device`
    (`int8_activations`: the 4-bit linears run W4A8 on CPU, QuantLinear.repack_for_cpu; `int8_prefill`: only
    prompt tokens do, None: where `int8_prefill_wanted` says;
    `int8_lm_head`: a float lm_head is held in int8 on CPU where `int8_head_unavailable` says nothing;
    None: where the checkpoint's linears are quantized, see `int8_head_wanted`)."""
    path, info, reader = source.path, source.quant, source.reader
    spec = source.spec  # unsupported architectures fail here, with the supported list
    shape = DecoderShape.from_config(source.hf_config)
    with torch.device("meta"):
        model = Decoder(shape)
    quantized = replace_packed_linears(model, reader, info, dtype)
    state = {}
    head_dtype = reader.dtype_of("lm_head.weight") if "lm_head.weight" in reader.keys() else None
    tied = "lm_head" not in quantized and (shape.tie_word_embeddings or "lm_head.weight" not in reader.keys())
    head_int8 = "lm_head" not in quantized and int8_head_wanted(int8_lm_head, bool(quantized), device, dtype,
                                                                shape.hidden_size)
    map_embed = device.type == "cpu" and EMBED in reader.keys() and reader.dtype_of(EMBED).is_floating_point \
        and reader.aligned(EMBED) and (not tied or head_int8)
    for key in reader.keys():
        if key.rpartition(".")[0] in quantized or "rotary_emb" in key or (key == EMBED and map_embed):
            continue
        t = reader.get(key)
        state[key] = t.to(table_dtype(t.dtype, dtype) if key == EMBED and not tied else dtype) \
            if t.is_floating_point() else t
    if tied:  # with the table mapped, the head is about to be rounded to int8: read at the checkpoint's precision
        state["lm_head.weight"] = reader.get(EMBED) if map_embed else state.get(EMBED)
    missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if v is not None},
                                                strict=False, assign=True)
    if unexpected:
        raise QuantkitError(f"{path}: unexpected tensors in the checkpoint: {', '.join(unexpected[:5])}")
    if map_embed:
        model.model.embed_tokens = MappedEmbedding(reader.mapped(EMBED))
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise QuantkitError(f"{path}: tensors missing from the checkpoint: {', '.join(still_meta[:5])}")
    # RoPE frequencies are not in checkpoints: the meta buffers are rebuilt for real.
    for r, params in enumerate(shape.all_ropes):
        setattr(model, rope_buffer(r), inv_frequencies(params, shape.head_dim, shape.max_position_embeddings))
    if spec.norms.offset:
        offset_norms(model, spec.norms.offset)
    model = model.to(device).eval()
    if device.type == "cpu":
        repack_quant_linears(model, dtype, int8_activations,
                             int8_prefill_wanted(int8_prefill, int8_activations, bool(quantized), dtype),
                             prefill_by_default=int8_prefill is None)
        fuse_quantized_projections(model)
        stack_moe_experts(model)
        if head_int8:
            # the decoder takes its logits in fp32: the kernel's fp32 sums as they are, neither rounded to bf16 nor
            # widened again (at 32 sequences of Llama 3's vocabulary that pass took about 3 ms of a 130 ms step)
            model.lm_head = Int8Linear.from_linear(model.lm_head, fp32_out=True)
            log.info("lm_head: int8, symmetric per row and group of %d columns (%s)", model.lm_head.group_size,
                     "--cpu-int8-lm-head" if int8_lm_head else "the default for a quantized checkpoint on this CPU; "
                     "--no-cpu-int8-lm-head keeps it float")
        elif not tied:
            hold_lm_head_bf16(model, head_dtype, dtype)
        prepack_float_linears(model, dtype)
    model.bind()  # the modules are final: each layer's parts fetched once for the forward
    log.info(WeightMemory.of(model).describe())
    return model, info


def offset_norms(model: torch.nn.Module, offset: float) -> None:
    """Every RMSNorm weight w becomes offset + w, computed in fp32 (Gemma's norms scale by 1 + w: the engine's norm
    ops then multiply by the stored weight, as for every other family)."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.weight.data = (m.weight.data.float() + offset).to(m.weight.dtype)


def int8_head_wanted(asked: bool | None, quantized: bool, device: torch.device, dtype: torch.dtype,
                     hidden_size: int) -> bool:
    """Whether a float lm_head is held in int8: where asked (a warning says why not, where it cannot be), and
    by default (`asked` None) for a checkpoint whose linears are quantized, where the int8 kernel runs. Its
    error is a small part of the 4-bit linears' (docs/BENCHMARKS.md: KL divergence from the float model)."""
    if asked is False or (asked is None and not quantized):
        return False
    why = int8_head_unavailable(device, dtype, hidden_size)
    if why is not None and asked:
        log.warning("lm_head: kept in float (%s)", why)
    return why is None


class MappedEmbedding(torch.nn.Module):
    """An embedding table read in place from the checkpoint (ShardReader.mapped): only the pages of rows
    that are looked up become resident, and they stay evictable page cache. `weight` is a plain attribute,
    not a parameter: WeightMemory counts it apart. ids [T] -> rows [T, hidden] in the stored dtype."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.weight = table
        self.num_embeddings, self.embedding_dim = table.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


def table_dtype(stored: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype the embedding table is held in: a 16-bit checkpoint's own when computing in fp32 (the
    decoder widens only the gathered rows, losslessly: half the bytes of an fp32 table), else `compute`."""
    return stored if compute == torch.float32 and stored in (torch.bfloat16, torch.float16) else compute


def hold_lm_head_bf16(model: torch.nn.Module, stored: torch.dtype | None, compute: torch.dtype) -> bool:
    """A float lm_head stored in bf16, computed in fp32: held in bf16 and run by quantkit's bf16-weight kernel
    (kernels/bf16_cpu.py: widened to fp32 exactly, half the bytes; measured faster than fp32 F.linear and
    prepacked oneDNN at M = 1 to 64 on 32000 x 1024, docs/BENCHMARKS.md). Lossless: the fp32 copy was widened
    from those bf16 values. Returns whether it was replaced."""
    from quantkit.kernels.bf16_cpu import Bf16Linear, unavailable

    head = model.lm_head
    if stored != torch.bfloat16 or compute != torch.float32 or type(head) is not torch.nn.Linear \
            or head.bias is not None:
        return False
    if (why := unavailable()) is not None:
        log.info("lm_head: fp32 (the bf16 kernel is unavailable: %s)", why)
        return False
    model.lm_head = Bf16Linear(head.weight.detach())
    return True


def int8_prefill_wanted(asked: bool | None, int8_activations: bool, quantized: bool, dtype: torch.dtype) -> bool:
    """Whether the prompt tokens of a 4-bit checkpoint run W4A8 on CPU while generated tokens run W4A16: where asked
    (a log line says why not, where it cannot be), and by default (`asked` None) where the int8-activation kernel
    for `dtype` builds and, in bf16 with AMX tiles, has its AMX-INT8 path (kernels/linear_choice.prompt_q8_not_default;
    then linears on AMX bf16 tiles whose groups the AMX-INT8 path does not take keep theirs). Its accuracy cost and
    speed: docs/BENCHMARKS.md "Real sizes"."""
    from quantkit.kernels.linear_choice import prompt_q8_not_default, prompt_q8_unavailable

    if asked is False or int8_activations or (asked is None and not quantized):
        return False
    why = "no quantized linears" if not quantized else prompt_q8_not_default(dtype) if asked is None \
        else prompt_q8_unavailable(dtype)
    if why is not None:
        (log.warning if asked else log.info)("prompt tokens: the linears' own arithmetic (%s)", why)
        return False
    log.info("prompt tokens: W4A8, activations rounded to int8 per row and group; generated tokens W4A16 (%s)",
             "--cpu-int8-prefill" if asked else "the default on this CPU; --no-cpu-int8-prefill keeps them W4A16")
    return True


def repack_quant_linears(model: torch.nn.Module, dtype: torch.dtype, int8_activations: bool = False,
                         int8_prefill: bool = False, prefill_by_default: bool = False) -> Counter:
    """Every QuantLinear into the CPU kernels' layout, checkpoint tensors dropped; counts of each path.
    `int8_prefill` for every linear but MoE experts (they see a share of the step's rows); `prefill_by_default`:
    the engine's default, not asked (QuantLinear.repack_for_cpu's by_default)."""
    experts = {id(m) for block in model.modules() if hasattr(block, "stack_experts")
               for m in getattr(block, block.spec.experts).modules()}
    paths = Counter(m.repack_for_cpu(dtype, int8_activations=int8_activations,
                                     int8_prefill=int8_prefill and id(m) not in experts,
                                     by_default=prefill_by_default)
                    for m in model.modules() if isinstance(m, QuantLinear))
    for path, n in paths.items():
        if path.startswith("dense"):
            log.warning("%d quantized linears run dequantized to a dense copy on CPU: %s", n, path)
    return paths


def prepack_float_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Every float nn.Linear into the CPU's fastest float linear for `dtype`, weight laid out once (a tied lm_head
    stays: a copy of the embedding would double it): in bf16 where the CPU computes it natively, quantkit's
    Bf16DotLinear (AMX tiles where the CPU has them; faster than oneDNN's prepacked GEMM at decode batch sizes and
    within 0.9x of it on prefill, docs/BENCHMARKS.md), else oneDNN's PrepackedLinear where oneDNN supports `dtype`,
    else F.linear. Each layer's q/k/v and gate/up become one linear in every case (so the engine's bound path
    applies). Returns how many were replaced."""
    from quantkit.kernels import bf16_cpu
    from quantkit.kernels.cpu_linear import PrepackedLinear, concat_linears, prepack_supported

    if dtype == torch.bfloat16 and bf16_cpu.bf16_dot_available():
        tiles = "AMX tiles" if bf16_cpu.extension().has_amx() else "AVX-512 BF16"
        kind, what = bf16_cpu.Bf16DotLinear, f"quantkit's bf16 kernel ({tiles})"
    elif prepack_supported(dtype):
        kind, what = PrepackedLinear, f"prepacked for oneDNN ({dtype})"
    else:
        fused = fuse_float_projections(model, concat_linears)
        log.info("linears: F.linear (oneDNN has no prepacked %s path on this CPU), %d of them fused q/k/v or gate/up",
                 dtype, fused)
        return fused

    def concat(linears):
        return kind.concat(linears) if all(kind.supports(m) for m in linears) else None

    fused = fuse_float_projections(model, concat)
    embed = model.model.embed_tokens.weight
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is torch.nn.Linear and m.weight.data_ptr() != embed.data_ptr()]
    for name, m in targets:
        parent, _, attr = name.rpartition(".")
        setattr(get_submodule(model, parent) if parent else model, attr,
                kind(m) if kind.supports(m) else PrepackedLinear(m) if prepack_supported(dtype) else m)
    log.info("linears: %d in %s, %d of them fused q/k/v or gate/up", len(targets) + fused, what, fused)
    return len(targets) + fused


def fuse_float_projections(model: torch.nn.Module, concat) -> int:
    """Each layer's q/k/v and gate/up, where all are float nn.Linear, into one `concat([...])` linear
    (quantized layers keep theirs). Returns how many fused linears were made."""
    return fuse_projections(model, torch.nn.Linear, concat)


def fuse_quantized_projections(model: torch.nn.Module) -> int:
    """Each layer's q/k/v and gate/up, where all run quantkit's int4 CPU kernel on layouts that concatenate,
    into one QuantLinear (one kernel call instead of three or two). Returns how many were made."""
    n = fuse_projections(model, QuantLinear, QuantLinear.concat)
    if n:
        log.info("quantized linears: %d fused q/k/v or gate/up", n)
    return n


def stack_moe_experts(model: torch.nn.Module) -> int:
    """Each MoE layer whose 4-bit experts share one layout into one stack, for the grouped kernel call
    (MoEBlock.stack_experts). Returns how many layers were stacked."""
    layers = [m for m in model.modules() if hasattr(m, "stack_experts")]
    n = sum(m.stack_experts() for m in layers)
    if layers:
        log.info("MoE layers: %d of %d run their experts in one grouped 4-bit kernel call", n, len(layers))
    return n


def fuse_projections(model: torch.nn.Module, kind: type, concat) -> int:
    """Each module's linears that read one input (its `fusable` names: q/k/v, a dense MLP's or an expert's
    gate/up), where all are exactly `kind`, into `concat([...])` (None: left apart)."""
    n = 0
    for owner in list(model.modules()):
        parts = getattr(owner, "fusable", ())
        modules = [getattr(owner, name, None) for name in parts]
        if parts and all(type(m) is kind for m in modules) and (fused := concat(modules)) is not None:
            owner.fuse(fused)
            n += 1
    return n


def module_bytes(module: torch.nn.Module) -> int:
    """Resident bytes of one module's weights: a QuantLinear's packed form, else its tensors."""
    if isinstance(module, QuantLinear):
        return module.weight_bytes()
    tensors = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _describe_part(nbytes: int, module: torch.nn.Module) -> str:
    kind = "packed" if isinstance(module, QuantLinear) else "int8" if isinstance(module, Int8Linear) else \
        str(next(iter(module.parameters()), next(iter(module.buffers()), torch.empty(0))).dtype).removeprefix("torch.")
    return f"{nbytes / 1024**2:.1f} MiB {kind}"


def _describe_tensor(t: torch.Tensor) -> str:
    return f"{t.numel() * t.element_size() / 1024**2:.1f} MiB {str(t.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class WeightMemory:
    """Resident weight bytes, against the same model held densely in bf16, with the parts that dominate
    a 4-bit model: the packed linears, the embedding table and lm_head (0 when tied to the embedding)."""

    resident: int
    bf16_equivalent: int
    paths: dict[str, int]  # how the quantized linears run on CPU (empty for a float model)
    quantized: int = 0  # resident bytes of the quantized linears (a quantized lm_head included)
    quantized_bf16: int = 0  # the same linears held densely in bf16
    embedding: int = 0
    lm_head: int = 0
    parts: str = ""  # "embedding 31.2 MiB bfloat16, lm_head 17.6 MiB packed"

    @classmethod
    def of(cls, model: torch.nn.Module) -> WeightMemory:
        resident = dense = 0
        seen: set[int] = set()
        quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
        for m in quant:
            resident += m.weight_bytes()
            dense += 2 * (m.in_features * m.out_features + (m.out_features if m.bias is not None else 0))
            seen.update(id(t) for t in m.buffers())
        quantized, quantized_bf16 = resident, dense
        for m in model.modules():
            if isinstance(m, Int8Linear):  # (bias-free)
                resident += m.weight_bytes()
                dense += 2 * m.in_features * m.out_features
                seen.update(id(t) for t in m.buffers())
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) in seen:  # (parameters() already lists a tied embedding once)
                continue
            seen.add(id(t))
            resident += t.numel() * t.element_size()
            dense += 2 * t.numel()
        embed, head = _embedding_and_head(model)
        if embed is None:
            return cls(resident, dense, dict(Counter(m.cpu_path for m in quant)), quantized, quantized_bf16)
        mapped = isinstance(embed, MappedEmbedding)
        if mapped:  # not resident: read in place from the checkpoint
            dense += 2 * embed.weight.numel()
        e_bytes = 0 if mapped else module_bytes(embed)
        h_bytes = 0 if _tied(embed, head) else module_bytes(head)
        e_part = (f"memory-mapped from the checkpoint ({_describe_tensor(embed.weight)}, rows read as looked up)"
                  if mapped else _describe_part(e_bytes, embed))
        parts = f"embedding {e_part}, lm_head " + \
            ("tied to the embedding" if h_bytes == 0 else _describe_part(h_bytes, head))
        return cls(resident, dense, dict(Counter(m.cpu_path for m in quant)), quantized, quantized_bf16,
                   e_bytes, h_bytes, parts)

    @property
    def read_per_token(self) -> int:
        """Bytes a dense model's batch-1 decode token reads: every resident weight but the embedding table, of which
        it reads one row, unless the table is the tied lm_head (then read whole). An MoE model reads less (top-k
        experts a layer)."""
        return self.resident - (self.embedding if self.lm_head else 0)

    def describe(self) -> str:
        mib = 1024**2
        text = (f"weights: {self.resident / mib:.1f} MiB resident, {self.resident / self.bf16_equivalent:.2f}x "
                f"of the model in bf16 ({self.bf16_equivalent / mib:.1f} MiB)")
        if self.parts:
            text += f"; {self.parts}"
        if self.paths:
            text += (f"; quantized linears {self.quantized / mib:.1f} MiB, {self.quantized / self.quantized_bf16:.2f}x "
                     "of theirs in bf16: " + ", ".join(f"{n} {p}" for p, n in sorted(self.paths.items())))
        return text


def _embedding_and_head(model: torch.nn.Module):
    backbone = getattr(model, "model", None)
    embed, head = getattr(backbone, "embed_tokens", None), getattr(model, "lm_head", None)
    return (None, None) if embed is None or head is None else (embed, head)


def _tied(embed: torch.nn.Module, head: torch.nn.Module) -> bool:
    w = getattr(head, "weight", None)
    return isinstance(w, torch.Tensor) and w.data_ptr() == embed.weight.data_ptr()
