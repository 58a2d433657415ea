"""The engine's own decoder, built from the HF config and the family's ArchSpec: Llama, Mistral, Qwen2 (q/k/v bias),
Qwen3 (q/k norms), Phi-3 (q/k/v and gate/up stored fused), Gemma 3 (scaled embeddings, (1 + w) norms around each
block, sliding-window layers with their own RoPE, soft-capped logits) and the MoE families (engine/moe.py).

Module names mirror the checkpoint's (model.layers.N.self_attn.q_proj, ...) so checkpoints load by
name. Every forward works on a flat batch: x [T, hidden], all scheduled tokens of all requests
together, with attention going through the paged cache. On CPU, once loaded (`Decoder.bind`), a step of a model
whose layers are all plain (pre-norm, fused projections, dense SiLU MLP, no q/k norm, window or cap) runs the layers
through `bound_layers_forward`: the same ops, each layer's parts fetched once instead of through nn.Module's
__call__ and attribute lookups at every layer (0.3-1.1 ms a step on the 8-layer benchmark model, docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit.engine.attention import AttentionMetadata, attend, attend_masked, paged_attention
from quantkit.engine.decoder_shape import DecoderShape
from quantkit.engine.moe import GatedMLP, MoEBlock
from quantkit.engine.rope import StepRope, inv_frequencies, rope_table
from quantkit.kernels import cpu_fused, fused_ops_reference
from quantkit.kernels.paged_attention_reference import write_kv

__all__ = ["Decoder", "DecoderLayer", "DecoderShape", "bound_layers_forward"]


def ops_for(x: torch.Tensor):
    """The elementwise ops for this forward: fused C++ on fp32 CPU where built, else torch (same signatures)."""
    return cpu_fused if cpu_fused.available(x) else fused_ops_reference


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32, then back: transformers' LlamaRMSNorm, bit for bit.
        return fused_ops_reference.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, s: DecoderShape, layer: int = 0):
        super().__init__()
        self.s = s
        # YaRN scales cos and sin by a factor: q and k both rotate with it, so the scores carry its square
        self.scale = (s.attn_scale or s.head_dim ** -0.5) * s.rope_factor(layer) ** 2
        self.window, self.softcap = s.window(layer), s.attn_softcap
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.qkv_proj: nn.Module | None = None  # q, k, v in one linear: stored so (Phi-3), or set by fuse()
        if s.fused_qkv:
            self.qkv_proj = nn.Linear(s.hidden_size, q + 2 * kv, bias=s.qkv_bias)
            self.fusable: tuple[str, ...] = ()
        else:
            self.q_proj = nn.Linear(s.hidden_size, q, bias=s.qkv_bias)
            self.k_proj = nn.Linear(s.hidden_size, kv, bias=s.qkv_bias)
            self.v_proj = nn.Linear(s.hidden_size, kv, bias=s.qkv_bias)
            self.fusable = ("q_proj", "k_proj", "v_proj")  # fused at load (weights.fuse_projections) in this order
        self.o_proj = nn.Linear(q, s.hidden_size, bias=s.o_bias)
        self.sinks: nn.Parameter | None = nn.Parameter(torch.zeros(s.num_heads)) if s.attn_sinks else None
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    @property
    def plain(self) -> bool:
        """Full causal attention without soft-capping or sinks: what the C++ kernel computes."""
        return self.window is None and self.softcap is None and self.sinks is None

    def fuse(self, qkv: nn.Module) -> None:
        """Run q/k/v as `qkv` from now on (built at load from the loaded three: x -> [q | k | v])."""
        del self.q_proj, self.k_proj, self.v_proj
        self.fusable = ()
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
        if rope.table is not None and self.qkv_proj is not None and not s.qk_norm and self.plain:
            # rotary and the cache write in one op on the fused projection's output (the table covers the step)
            q = ops.rope_and_cache(self.qkv_proj(x), rope.positions, rope.table, kv[0], kv[1], meta.slot_mapping,
                                   s.num_heads, s.num_kv_heads)
            return self.o_proj(attend(q, kv[0], kv[1], meta, self.scale).reshape(t, s.num_heads * s.head_dim))
        cos, sin = rope.cos_sin()
        q, k, v = self.project(x)
        q = q.view(t, s.num_heads, s.head_dim)  # [T, heads, D]
        k = k.view(t, s.num_kv_heads, s.head_dim)  # [T, kv_heads, D]
        v = v.view(t, s.num_kv_heads, s.head_dim)
        if s.qk_norm:  # Qwen3, Gemma 3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(q, k, cos, sin)
        if self.plain:
            out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        else:
            write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
            out = attend_masked(q, kv[0], kv[1], meta, self.scale, self.window, self.softcap, self.sinks)
        return self.o_proj(out.reshape(t, s.num_heads * s.head_dim))


def make_mlp(s: DecoderShape) -> nn.Module:
    """The layer's feed-forward block: an MoE block (ExpertsSpec) or a dense gated MLP under Llama's names."""
    if s.moe is not None:
        return MoEBlock(s)
    return GatedMLP(s.hidden_size, s.intermediate_size, s.act, ("gate_proj", "up_proj", "down_proj"),
                    "gate_up_proj" if s.fused_gate_up else None)


class DecoderLayer(nn.Module):
    """One decoder layer, its norms under the spec's names (LayerNorms): pre-norm, and for Gemma 3 the attention
    and MLP outputs normalized too before the residual add."""

    def __init__(self, s: DecoderShape, index: int = 0):
        super().__init__()
        self.norms = s.norms
        for name in (s.norms.attn_in, s.norms.mlp_in, s.norms.attn_out, s.norms.mlp_out):
            if name is not None:
                setattr(self, name, RMSNorm(s.hidden_size, s.rms_norm_eps))
        self.self_attn = Attention(s, index)
        self.mlp_name = s.experts.block if s.moe is not None else "mlp"
        setattr(self, self.mlp_name, make_mlp(s))
        self.plain = (s.norms.attn_out is None and s.norms.mlp_out is None and s.moe is None and not s.qk_norm
                      and self.self_attn.plain and s.act == "silu" and s.rope_index(index) == 0)

    def forward(self, x, residual, rope, kv, meta, ops):
        """x: the previous layer's MLP output, residual: the stream before it (None at layer 0, where x is
        the embedding). Returns this layer's (MLP output, residual stream): the add is fused into the next norm."""
        n = self.norms
        norm = getattr(self, n.attn_in)
        if residual is None:
            h, residual = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        a = self.self_attn(h, rope, kv, meta, ops)
        if n.attn_out is not None:
            norm = getattr(self, n.attn_out)
            a = ops.rms_norm(a, norm.weight, norm.eps)
        norm = getattr(self, n.mlp_in)
        h, residual = ops.add_rms_norm(a, residual, norm.weight, norm.eps)
        m = getattr(self, self.mlp_name)(h, ops)
        if n.mlp_out is not None:
            norm = getattr(self, n.mlp_out)
            m = ops.rms_norm(m, norm.weight, norm.eps)
        return m, residual


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
        """None where the layer's forward takes another way: q/k/v or gate/up not fused, or a layer that is not
        plain (DecoderLayer.plain: q/k norms, sandwich norms, experts, a window or cap, another RoPE, GELU)."""
        attn, mlp = layer.self_attn, getattr(layer, layer.mlp_name)
        if not layer.plain or attn.qkv_proj is None or mlp.gate_up_proj is None:
            return None
        pre, post = getattr(layer, layer.norms.attn_in), getattr(layer, layer.norms.mlp_in)
        return cls(pre.weight, pre.eps, attn.qkv_proj, attn.o_proj, post.weight, post.eps, mlp.gate_up_proj,
                   getattr(mlp, mlp.down_name), attn.scale)


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
        self.layers = nn.ModuleList(DecoderLayer(s, i) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class Decoder(nn.Module):
    """A CausalLM over a paged KV cache: forward(token ids, positions, caches, metadata) -> logits."""

    def __init__(self, s: DecoderShape):
        super().__init__()
        self.shape = s
        self.model = Backbone(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        # RoPE frequencies: inv_freq for ropes[0] (the one a rope table may hold), inv_freq_<r> for the others
        for r, params in enumerate(s.all_ropes):
            self.register_buffer(rope_buffer(r), inv_frequencies(params, s.head_dim, s.max_position_embeddings),
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
                logits_rows: torch.Tensor, hidden_rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions [T] int64 -> (logits [len(logits_rows), vocab] fp32, the final-normed hidden states
        [len(hidden_rows), hidden] fp32 that embeddings pool, or None without hidden_rows)."""
        # x: [T, hidden] in the compute dtype (the norms'); the table may be held in 16 bits (weights.table_dtype)
        s = self.shape
        x = self.model.embed_tokens(input_ids).to(self.model.norm.weight.dtype)
        if s.embed_scale is not None:  # Gemma: times sqrt(hidden) rounded to the compute dtype, as transformers
            x = x * torch.tensor(s.embed_scale, dtype=x.dtype)
        table = self._rope_rows(max(meta.seq_lens, default=0), x.dtype)
        ropes = [StepRope(getattr(self, rope_buffer(r)), positions, x.dtype, table if r == 0 else None)
                 for r in range(len(s.all_ropes))]
        ops = ops_for(x)
        if self.bound_layers is not None and table is not None:
            x, residual = bound_layers_forward(self.bound_layers, s, x, ropes[0], kv_caches, meta, ops)
        else:
            residual = None
            for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches)):
                x, residual = layer(x, residual, ropes[s.rope_index(i)], kv, meta, ops)
        norm = self.model.norm
        rows = logits_rows if hidden_rows is None else torch.cat([logits_rows, hidden_rows])  # one norm for both
        # index_select, not x[rows]: the same rows, a quarter of the time at decode sizes (advanced indexing)
        x, _ = ops.add_rms_norm(x.index_select(0, rows), residual.index_select(0, rows), norm.weight, norm.eps)
        num_logits = logits_rows.shape[0]
        hidden = None if hidden_rows is None else x[num_logits:].float()
        logits = self.lm_head(x if hidden_rows is None else x[:num_logits]).float()
        if s.final_softcap is not None:  # Gemma: c * tanh(logits / c)
            logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return logits, hidden


def rope_buffer(index: int) -> str:
    """The Decoder buffer holding the inv_freq of RoPE setting `index` (DecoderShape.all_ropes)."""
    return "inv_freq" if index == 0 else f"inv_freq_{index}"
