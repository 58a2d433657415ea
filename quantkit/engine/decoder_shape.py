"""DecoderShape: what the engine's decoder needs from an HF config and the family's spec, normalised.

The spec (quantkit.format.arch) says how a layer runs (norm placement, fused projections, experts,
scaled embeddings); the config gives the numbers and the per-layer attention: which layers slide a
window (`layer_types` + `sliding_window`, or a window on every layer), which RoPE each uses, soft-caps.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.engine.rope import attention_factor, layer_rope_parameters
from quantkit.errors import QuantkitError
from quantkit.format.arch import ExpertsSpec, LayerNorms, MoEShape, moe_shape, spec_for
from quantkit.model.moe import SWIGLU, swiglu_params

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swiglu_oai")  # the MLPs' gate activations the engine computes


@dataclass(frozen=True)
class DecoderShape:
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
    rope: dict  # layer 0's RoPE settings (ropes[layer_rope[0]])
    sliding_window: int | None = None  # the window of the sliding layers (None: no layer slides)
    act: str = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    windows: tuple[int | None, ...] = ()  # per layer: its sliding window, or None (() : none anywhere)
    ropes: tuple[dict, ...] = ()  # the distinct RoPE settings (() : just `rope`)
    layer_rope: tuple[int, ...] = ()  # per layer: its index in ropes (() : 0 everywhere)
    attn_softcap: float | None = None  # attention scores capped to c * tanh(s / c)
    final_softcap: float | None = None  # logits capped likewise
    norms: LayerNorms = LayerNorms()
    embed_scale: float | None = None  # Gemma: embedding rows times sqrt(hidden_size)
    fused_qkv: bool = False  # the checkpoint stores q/k/v as one qkv_proj (Phi-3)
    fused_gate_up: bool = False  # and gate/up as one gate_up_proj
    experts: ExpertsSpec | None = None  # an MoE family's block names
    moe: MoEShape | None = None
    o_bias: bool = False  # o_proj has a bias (config.attention_bias: Llama, gpt-oss)
    attn_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax (self_attn.sinks)
    swiglu: tuple[float, float] = SWIGLU  # swiglu_oai's (alpha, limit)
    rope_factors: tuple[float, ...] = ()  # per RoPE setting (all_ropes): the factor YaRN scales cos/sin by

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def rope_index(self, layer: int) -> int:
        return self.layer_rope[layer] if self.layer_rope else 0

    @property
    def all_ropes(self) -> tuple[dict, ...]:
        return self.ropes or (self.rope,)

    def rope_factor(self, layer: int) -> float:
        """The factor this layer's RoPE multiplies cos and sin by (YaRN; 1 otherwise)."""
        return self.rope_factors[self.rope_index(layer)] if self.rope_factors else 1.0

    @classmethod
    def from_config(cls, config) -> DecoderShape:
        spec = spec_for(config)
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
        if spec.experts is not None and spec.experts.act is not None:
            act = spec.experts.act
        if act not in ACTIVATIONS:
            raise QuantkitError(f"unsupported hidden_act {act!r} (the engine's MLPs compute {', '.join(ACTIVATIONS)})")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        ropes, layer_rope = layer_rope_parameters(config)
        windows = layer_windows(config)
        scalar = getattr(config, "query_pre_attn_scalar", None)
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim, rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=spec.qkv_bias or bool(getattr(config, "attention_bias", False)), qk_norm=spec.qk_norm,
            rope=ropes[layer_rope[0]], sliding_window=next((w for w in windows if w is not None), None), act=act,
            attn_scale=None if scalar is None else float(scalar) ** -0.5,
            windows=windows if any(w is not None for w in windows) else (),
            ropes=ropes if len(ropes) > 1 else (), layer_rope=layer_rope if len(ropes) > 1 else (),
            attn_softcap=getattr(config, "attn_logit_softcapping", None),
            final_softcap=getattr(config, "final_logit_softcapping", None),
            norms=spec.norms, embed_scale=config.hidden_size ** 0.5 if spec.embed_scale else None,
            fused_qkv="self_attn.qkv_proj" in spec.linears, fused_gate_up="mlp.gate_up_proj" in spec.linears,
            experts=spec.experts, moe=moe_shape(spec, config),
            o_bias=bool(getattr(config, "attention_bias", False)), attn_sinks=spec.attn_sinks,
            swiglu=swiglu_params(config),
            rope_factors=tuple(attention_factor(r) for r in ropes) if any(attention_factor(r) != 1 for r in ropes)
            else (),
        )


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window (keys p - window < j <= p seen by the query at p), None for full attention:
    the `sliding_attention` layers of `layer_types` where the config lists them, else every layer where it
    sets `sliding_window` (Mistral, Phi-3) and does not switch it off (`use_sliding_window`). A window as long
    as the model's context never binds and counts as none."""
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if window is None or not getattr(config, "use_sliding_window", True) \
            or window >= config.max_position_embeddings:
        return (None,) * n
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (int(window),) * n
