"""Architecture knowledge as data: one typed spec per model family.

A spec says where the decoder layers live, which linears of a layer share an input
(and so are quantized together, in order: true-sequential), which op feeds each group
(a norm or another linear: AWQ folds its scales into that op), and which module's output
AWQ measures when it searches a group's scale. Looked up by the checkpoint's
`config.architectures[0]`; the pipeline, the AWQ search and the loader read these specs
instead of matching module types or names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class LinearGroup:
    """Linears of one decoder layer that read the same input (names relative to the layer)."""

    name: str
    linears: tuple[str, ...]
    feeder: str  # the op whose output is the group's input, relative to the layer
    feeder_is_norm: bool  # True: an RMSNorm weight [K]; False: a linear whose output rows feed K
    inspect: str  # module whose output AWQ compares before/after scaling (relative to the layer)
    # v_proj -> o_proj: under GQA each feeder row (a KV-head channel) is read by heads / kv_heads query
    # heads, so the group's scale [heads * head_dim] is tied over those heads (kv_part gives the feeder's share)
    feeder_repeats_kv: bool = False
    fused: str | None = None  # the one linear serving engines (vLLM) fuse the group into: all packed or none

    @property
    def inspects_its_linear(self) -> bool:
        """AWQ judges this group on its own single linear's output (o_proj, down_proj), a quadratic
        form in the inputs, rather than on a larger module's (attention, MLP)."""
        return self.linears == (self.inspect,)


@dataclass(frozen=True)
class ArchSpec:
    family: str
    architectures: tuple[str, ...]
    layers: str  # attribute path of the decoder layer list, from the CausalLM root
    embed: str
    final_norm: str
    lm_head: str
    groups: tuple[LinearGroup, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    # linears AWQ quantizes without a clip search. None by default: llm-awq and AutoAWQ leave q/k
    # unclipped (the softmax amplifies a clipped outlier), but over three calibration seeds clipping
    # them too gave the lower perplexity on both test models, with and without duo scaling
    # (docs/BENCHMARKS.md, "AWQ: which linears to clip")
    awq_no_clip: tuple[str, ...] = ()

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for g in self.groups for name in g.linears)


_LLAMA_GROUPS = (
    LinearGroup("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                feeder="input_layernorm", feeder_is_norm=True, inspect="self_attn", fused="self_attn.qkv_proj"),
    LinearGroup("o", ("self_attn.o_proj",), feeder="self_attn.v_proj", feeder_is_norm=False,
                inspect="self_attn.o_proj", feeder_repeats_kv=True),
    LinearGroup("gate_up", ("mlp.gate_proj", "mlp.up_proj"),
                feeder="post_attention_layernorm", feeder_is_norm=True, inspect="mlp", fused="mlp.gate_up_proj"),
    LinearGroup("down", ("mlp.down_proj",), feeder="mlp.up_proj", feeder_is_norm=False, inspect="mlp.down_proj"),
)


def _family(family: str, architectures: tuple[str, ...], **kw) -> ArchSpec:
    return ArchSpec(
        family=family, architectures=architectures, layers="model.layers", embed="model.embed_tokens",
        final_norm="model.norm", lm_head="lm_head", groups=_LLAMA_GROUPS, **kw,
    )


SPECS: tuple[ArchSpec, ...] = (
    _family("llama", ("LlamaForCausalLM",)),
    _family("mistral", ("MistralForCausalLM",)),
    _family("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True),
    _family("qwen3", ("Qwen3ForCausalLM",), qk_norm=True),
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for s in SPECS for a in s.architectures)


def spec_for(config) -> ArchSpec:
    """The spec for a transformers config (or a dict with 'architectures')."""
    archs = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    arch = (archs or [None])[0]
    for spec in SPECS:
        if arch in spec.architectures:
            return spec
    raise QuantkitError(
        f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def tie_over_query_heads(s: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Average a per-channel statistic s [heads * head_dim] (an o_proj input) over the query heads
    sharing a KV head, and repeat it back: the result is constant over each such set. [same shape]."""
    grouped = s.reshape(kv_heads, heads // kv_heads, -1)  # [kv, rep, head_dim]: query head h reads kv head h // rep
    return grouped.mean(dim=1, keepdim=True).expand_as(grouped).reshape(s.shape)


def kv_part(s: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """The KV-head channels [kv_heads * head_dim] of a scale tied over query heads [heads * head_dim]."""
    return s.reshape(kv_heads, heads // kv_heads, -1)[:, 0].reshape(-1)


def head_counts(model_config) -> tuple[int, int]:
    """(num_attention_heads, num_key_value_heads) of a transformers config or a config dict."""
    get = model_config.get if isinstance(model_config, dict) else (lambda k: getattr(model_config, k, None))
    heads = int(get("num_attention_heads"))
    return heads, int(get("num_key_value_heads") or heads)


def get_submodule(root, path: str):
    """root.a.b.c for path 'a.b.c'."""
    mod = root
    for part in path.split("."):
        mod = getattr(mod, part)
    return mod
