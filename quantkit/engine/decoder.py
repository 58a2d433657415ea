"""The engine's own decoder for the Llama family (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with
q/k norms), built from the HF config and an ArchSpec.

Module names mirror transformers' (model.layers.N.self_attn.q_proj, ...) so checkpoints load by
name. Every forward works on a flat batch: x [T, hidden], all scheduled tokens of all requests
together, with attention going through the paged cache. On CPU, once loaded (`Decoder.bind`), a step runs
the layers through `bound_layers_forward`: the same ops, each layer's parts fetched once instead of
through nn.Module's __call__ and attribute lookups at every layer (0.3-1.1 ms a step on the 8-layer
benchmark model, docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit.engine.attention import AttentionMetadata, attend, paged_attention
from quantkit.engine.rope import StepRope, inv_frequencies, rope_parameters, rope_table
from quantkit.errors import QuantkitError
from quantkit.format.arch import spec_for
from quantkit.kernels import cpu_fused, fused_ops_reference


def ops_for(x: torch.Tensor):
    """The elementwise ops for this forward: fused C++ on fp32 CPU where built, else torch (same signatures)."""
    return cpu_fused if cpu_fused.available(x) else fused_ops_reference


@dataclass(frozen=True)
class DecoderShape:
    """What the decoder needs from an HF config, normalised."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: dict
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, config) -> DecoderShape:
        spec = spec_for(config)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise QuantkitError(f"unsupported hidden_act {act!r} (the engine's decoder uses SiLU)")
        heads = config.num_attention_heads
        use_window = getattr(config, "use_sliding_window", True)
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=spec.qkv_bias or bool(getattr(config, "attention_bias", False)), qk_norm=spec.qk_norm,
            rope=rope_parameters(config),
            sliding_window=getattr(config, "sliding_window", None) if use_window else None,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32, then back: transformers' LlamaRMSNorm, bit for bit.
        return fused_ops_reference.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, s: DecoderShape):
        super().__init__()
        self.s = s
        self.scale = s.head_dim ** -0.5
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.qkv_proj: nn.Module | None = None  # set by fuse(): q, k, v in one linear
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    def fuse(self, qkv: nn.Module) -> None:
        """Run q/k/v as `qkv` from now on (built at load from the loaded three: x -> [q | k | v])."""
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = qkv

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, heads * D], k, v [T, kv_heads * D]; each contiguous (the C++ ops need it)."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        s = self.s
        q, k, v = self.qkv_proj(x).split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim,
                                          s.num_kv_heads * s.head_dim], dim=-1)
        return q.contiguous(), k.contiguous(), v  # (one token: views already contiguous, no copy)

    def forward(self, x: torch.Tensor, rope: StepRope, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, ops=fused_ops_reference) -> torch.Tensor:
        t, s = x.shape[0], self.s
        if rope.table is not None and self.qkv_proj is not None and not s.qk_norm:
            # rotary and the cache write in one op on the fused projection's output (the table covers the step)
            q = ops.rope_and_cache(self.qkv_proj(x), rope.positions, rope.table, kv[0], kv[1], meta.slot_mapping,
                                   s.num_heads, s.num_kv_heads)
            return self.o_proj(attend(q, kv[0], kv[1], meta, self.scale).reshape(t, s.num_heads * s.head_dim))
        cos, sin = rope.cos_sin()
        q, k, v = self.project(x)
        q = q.view(t, s.num_heads, s.head_dim)  # [T, heads, D]
        k = k.view(t, s.num_kv_heads, s.head_dim)  # [T, kv_heads, D]
        v = v.view(t, s.num_kv_heads, s.head_dim)
        if s.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(q, k, cos, sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.o_proj(out.reshape(t, s.num_heads * s.head_dim))


class MLP(nn.Module):
    def __init__(self, s: DecoderShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by fuse(): gate and up in one linear

    def fuse(self, gate_up: nn.Module) -> None:
        """Run gate/up as `gate_up` from now on (built at load from the loaded two: x -> [gate | up])."""
        del self.gate_proj, self.up_proj
        self.gate_up_proj = gate_up

    def forward(self, x: torch.Tensor, ops=fused_ops_reference) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(ops.silu_and_mul(self.gate_proj(x), self.up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # views of [T, 2I]: the op reads them strided
        return self.down_proj(ops.silu_and_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, s: DecoderShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def forward(self, x, residual, rope, kv, meta, ops):
        """x: the previous layer's MLP output, residual: the stream before it (None at layer 0, where x is
        the embedding). Returns this layer's (MLP output, residual stream): the add is fused into the next norm."""
        norm = self.input_layernorm
        if residual is None:
            h, residual = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        a = self.self_attn(h, rope, kv, meta, ops)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(a, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual


@dataclass(frozen=True, slots=True)
class BoundLayer:
    """A decoder layer's parts as `Decoder.forward` calls them on its bound path: fetched once (by `Decoder.bind`),
    not through nn.Module's __call__ and __getattr__ at every layer of every step. The path is the layer's
    forward with a rope table and fused projections (DecoderLayer -> Attention -> MLP), flattened."""

    input_norm: torch.Tensor
    input_eps: float
    qkv: nn.Module
    o: nn.Module
    post_norm: torch.Tensor
    post_eps: float
    gate_up: nn.Module
    down: nn.Module
    scale: float

    @classmethod
    def of(cls, layer: DecoderLayer) -> BoundLayer | None:
        """None where the layer's forward takes another way: q/k/v or gate/up not fused, or per-head q/k norms."""
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None or mlp.gate_up_proj is None or attn.s.qk_norm:
            return None
        return cls(layer.input_layernorm.weight, layer.input_layernorm.eps, attn.qkv_proj, attn.o_proj,
                   layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, mlp.gate_up_proj,
                   mlp.down_proj, attn.scale)


def bound_layers_forward(layers: list[BoundLayer], s: DecoderShape, x: torch.Tensor, rope: StepRope,
                         kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                         ops) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers on x [T, hidden] (rope.table set): (the last MLP output, the residual stream), the same ops in the
    same order as DecoderLayer.forward's rope-table branch, so the results are bit-equal."""
    t, heads, kv_heads = x.shape[0], s.num_heads, s.num_kv_heads
    width = heads * s.head_dim
    positions, table, slots = rope.positions, rope.table, meta.slot_mapping
    residual = None
    for layer, (key_cache, value_cache) in zip(layers, kv_caches):
        if residual is None:
            h, residual = ops.rms_norm(x, layer.input_norm, layer.input_eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, layer.input_norm, layer.input_eps)
        q = ops.rope_and_cache(layer.qkv.forward(h), positions, table, key_cache, value_cache, slots, heads, kv_heads)
        a = layer.o.forward(attend(q, key_cache, value_cache, meta, layer.scale).reshape(t, width))
        h, residual = ops.add_rms_norm(a, residual, layer.post_norm, layer.post_eps)
        gate, up = layer.gate_up.forward(h).chunk(2, dim=-1)
        x = layer.down.forward(ops.silu_and_mul(gate, up))
    return x, residual


class Backbone(nn.Module):
    def __init__(self, s: DecoderShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class Decoder(nn.Module):
    """A CausalLM over a paged KV cache: forward(token ids, positions, caches, metadata) -> logits."""

    def __init__(self, s: DecoderShape):
        super().__init__()
        self.shape = s
        self.model = Backbone(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_frequencies(s.rope, s.head_dim, s.max_position_embeddings),
                             persistent=False)
        self.rope_limit: int | None = None  # use_rope_table: positions a rope table may cover (None: no table)
        self.rope_table: torch.Tensor | None = None  # cos | sin by position, grown as sequences grow
        self.bound_layers: list[BoundLayer] | None = None  # set by bind()

    def bind(self) -> bool:
        """Fetch each layer's parts once for the bound path (`BoundLayer`), which steps with a rope table then take:
        after loading and fusing, and again after replacing any layer's modules. Returns whether every layer can
        (else the forward keeps going through the modules)."""
        layers = [BoundLayer.of(layer) for layer in self.model.layers]
        self.bound_layers = layers if all(b is not None for b in layers) else None
        return self.bound_layers is not None

    def use_rope_table(self, positions: int) -> None:
        """From now on hold cos | sin by position (up to `positions`) for the fused rotary + cache write, on CPU
        with a full-width rotary (elsewhere each step computes its cos and sin). The table grows by doubling
        with the longest sequence seen (64 MiB in bf16 would cover 128K positions of head dim 128 up front)."""
        if self.inv_freq.device.type == "cpu" and 2 * self.inv_freq.numel() == self.shape.head_dim:
            self.rope_limit = positions

    def _rope_rows(self, need: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The rope table covering positions below `need` in `dtype`, or None where none may be held."""
        if self.rope_limit is None or need > self.rope_limit:
            return None
        table = self.rope_table
        if table is None or table.shape[0] < need or table.dtype != dtype:
            rows = min(self.rope_limit, max(256, 1 << max(need - 1, 1).bit_length()))
            self.rope_table = table = rope_table(self.inv_freq, rows, dtype)
        return table

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64 -> logits [len(logits_rows), vocab] fp32."""
        # x: [T, hidden] in the compute dtype (the norms'); the table may be held in 16 bits (weights.table_dtype)
        x = self.model.embed_tokens(input_ids).to(self.model.norm.weight.dtype)
        rope = StepRope(self.inv_freq, positions, x.dtype, self._rope_rows(max(meta.seq_lens, default=0), x.dtype))
        ops = ops_for(x)
        if self.bound_layers is not None and rope.table is not None:
            x, residual = bound_layers_forward(self.bound_layers, self.shape, x, rope, kv_caches, meta, ops)
        else:
            residual = None
            for layer, kv in zip(self.model.layers, kv_caches):
                x, residual = layer(x, residual, rope, kv, meta, ops)
        norm = self.model.norm
        # index_select, not x[rows]: the same rows, a quarter of the time at decode sizes (advanced indexing)
        x, _ = ops.add_rms_norm(x.index_select(0, logits_rows), residual.index_select(0, logits_rows), norm.weight,
                                norm.eps)
        return self.lm_head(x).float()
