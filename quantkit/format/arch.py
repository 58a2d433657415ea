"""Architecture knowledge as data: one typed spec per model family.

A spec says where the decoder layers live, which linears of a layer share an input (and so are
quantized together, in order: true-sequential), which op feeds each group (a norm or another
linear: AWQ folds its scales into that op), which module's output AWQ measures when it searches a
group's scale, and how the layer runs: where its norms sit (`LayerNorms`), whether its MLP is a
sparse mixture of experts (`ExpertsSpec`), whether embeddings are scaled. Looked up by the
checkpoint's `config.architectures[0]`; the pipeline, the AWQ search, the loaders, the checker and
the engine read these specs instead of matching module types or names. Adding a dense family is a
spec here and a test.

Names are relative to a decoder layer and are the checkpoint's (what vLLM and transformers read):
Mixtral's experts are `block_sparse_moe.experts.<e>.w1` even though transformers 5 calls the block
`mlp` and stacks the experts into 3-D tensors (quantkit.model.moe replaces that block with one
linear per expert, under the checkpoint's names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # the group reads only the feeder's last output rows: Phi-3's o_proj reads the v rows of qkv_proj [q | k | v],
    # its down_proj the up rows of gate_up_proj [gate | up]; AWQ divides those rows only
    feeder_tail: bool = False
    # a gated MLP's down_proj reads act(gate's output) * the feeder's: the gate linear, or the feeder itself where
    # it is fused [gate | up] (feeder_tail: the gate is its head rows); None where nothing gates the feeder
    gate: str | None = None

    @property
    def inspects_its_linear(self) -> bool:
        """AWQ judges this group on its own single linear's output (o_proj, down_proj), a quadratic
        form in the inputs, rather than on a larger module's (attention, MLP)."""
        return self.linears == (self.inspect,)


@dataclass(frozen=True)
class LayerNorms:
    """Where a decoder layer's RMSNorms sit (names relative to the layer).

    Pre-norm (Llama): x + attn(attn_in(x)), then + mlp(mlp_in(.)). Gemma 3 also normalizes each
    block's output before the residual add (attn_out, mlp_out: "sandwich" norms), and its norms
    scale by (1 + weight): `offset` 1, which AWQ's folds and the engine's loader account for."""

    attn_in: str = "input_layernorm"
    mlp_in: str = "post_attention_layernorm"
    attn_out: str | None = None
    mlp_out: str | None = None
    offset: float = 0.0


@dataclass(frozen=True)
class ExpertsSpec:
    """A sparse mixture-of-experts MLP: a float router picks top_k experts per token, each a gated MLP
    down(act(gate(x)) * up(x)); the block's output is their sum weighted by the routing weights."""

    block: str  # the MoE block as the checkpoint names it, relative to the layer
    hf_attr: str  # the attribute transformers' decoder layer calls (transformers 5 renames Mixtral's to `mlp`)
    gate: str  # one expert's linears, relative to the expert
    up: str
    down: str
    router: str = "gate"  # relative to the block: nn.Linear [experts, hidden], kept float (as vLLM and the peers)
    experts: str = "experts"
    renormalize: bool | None = None  # top-k weights renormalized to sum 1; None: the config's norm_topk_prob
    # gpt-oss: the checkpoint holds each projection of all experts as one tensor `<block>.<experts>.<name>`
    # [E, in, out] (and `<name>_bias` [E, out]), read as one linear per expert (quantkit.model.stacked_experts);
    # gate and up are one projection, `gate_up`, whose output rows interleave gate and up (g0, u0, g1, u1, ...);
    # every expert linear and the router have a bias; the activation is `act` rather than the config's hidden_act
    stacked: bool = False
    returns_pair: bool = False  # transformers' layer unpacks (output, router scores) from the block (gpt-oss)
    gate_up: str | None = None
    bias: bool = False
    router_bias: bool = False
    act: str | None = None

    @property
    def router_path(self) -> str:
        return f"{self.block}.{self.router}"

    @property
    def inputs(self) -> tuple[str, ...]:
        """An expert's linears that read the block's input: (gate, up), or the one gate_up."""
        return (self.gate_up,) if self.gate_up else (self.gate, self.up)

    @property
    def projections(self) -> tuple[str, ...]:
        """An expert's linears in the order it runs them (names relative to the expert)."""
        return (*self.inputs, self.down)

    @property
    def down_scales_through_up(self) -> bool:
        """AWQ may fold a scale of down's input into up's rows: down reads act(gate) * up, linear in up. Not so for
        gpt-oss's (clamp(up) + 1) * glu(gate)."""
        return self.gate_up is None

    def expert(self, e: int) -> str:
        return f"{self.block}.{self.experts}.{e}"

    def linears_of(self, e: int) -> tuple[str, ...]:
        """Expert e's linears (gate, up, down; or gate_up, down), relative to the layer."""
        p = self.expert(e)
        return tuple(f"{p}.{leaf}" for leaf in self.projections)

    def parse(self, linear: str) -> tuple[int, str] | None:
        """(expert, role) of an expert linear's name relative to the layer ('gate', 'up', 'down' or 'gate_up');
        None else."""
        head = f"{self.block}.{self.experts}."
        if not linear.startswith(head):
            return None
        index, _, leaf = linear[len(head):].partition(".")
        roles = {self.gate_up: "gate_up", self.down: "down"} if self.gate_up else \
            {self.gate: "gate", self.up: "up", self.down: "down"}
        role = roles.get(leaf)
        return (int(index), role) if index.isdigit() and role else None


@dataclass(frozen=True)
class MoEShape:
    """An MoE family's numbers, from its config."""

    num_experts: int
    top_k: int
    intermediate: int  # one expert's
    renormalize: bool


# (out_features, in_features) of each dense linear in config dimensions: "q" = heads x head_dim, "kv" = kv heads
# x head_dim, "qkv" = q + 2 kv, "2intermediate" = gate and up stacked
LLAMA_DIMS: dict[str, tuple[str, str]] = {
    "self_attn.q_proj": ("q", "hidden"), "self_attn.k_proj": ("kv", "hidden"),
    "self_attn.v_proj": ("kv", "hidden"), "self_attn.o_proj": ("hidden", "q"),
    "mlp.gate_proj": ("intermediate", "hidden"), "mlp.up_proj": ("intermediate", "hidden"),
    "mlp.down_proj": ("hidden", "intermediate"),
}
EXPERT_DIMS = {"gate": ("expert_intermediate", "hidden"), "up": ("expert_intermediate", "hidden"),
               "down": ("hidden", "expert_intermediate"), "gate_up": ("2expert_intermediate", "hidden")}


@dataclass(frozen=True)
class ArchSpec:
    family: str
    architectures: tuple[str, ...]
    layers: str  # attribute path of the decoder layer list, from the CausalLM root
    embed: str
    final_norm: str
    lm_head: str
    groups: tuple[LinearGroup, ...]  # the dense linears (an MoE family's experts are in `experts`)
    qkv_bias: bool = False
    qk_norm: bool = False
    # linears AWQ quantizes without a clip search. None by default: llm-awq and AutoAWQ leave q/k
    # unclipped (the softmax amplifies a clipped outlier), but over three calibration seeds clipping
    # them too gave the lower perplexity on both test models, with and without duo scaling
    # (docs/BENCHMARKS.md, "AWQ: which linears to clip")
    awq_no_clip: tuple[str, ...] = ()
    norms: LayerNorms = LayerNorms()
    experts: ExpertsSpec | None = None
    embed_scale: bool = False  # Gemma: embedding rows are multiplied by sqrt(hidden_size) (in the table's dtype)
    attn_sinks: bool = False  # gpt-oss: a learned logit per head (`self_attn.sinks`) joins every softmax
    dims: dict[str, tuple[str, str]] = field(default_factory=lambda: dict(LLAMA_DIMS))

    @property
    def linears(self) -> tuple[str, ...]:
        """The dense linears of a layer, in the order the layer runs them."""
        return tuple(name for g in self.groups for name in g.linears)

    def expert_linears(self, num_experts: int) -> tuple[str, ...]:
        """Every expert's linears (ExpertsSpec.linears_of), expert by expert ([] for a dense family)."""
        if self.experts is None:
            return ()
        return tuple(n for e in range(num_experts) for n in self.experts.linears_of(e))

    def layer_linears(self, config) -> tuple[str, ...]:
        """Every quantizable linear of a layer: the dense ones, then the experts'."""
        moe = moe_shape(self, config)
        return self.linears + self.expert_linears(moe.num_experts if moe else 0)

    def expert_awq_groups(self, num_experts: int) -> tuple[LinearGroup, ...]:
        """AWQ's groups over the experts: the MLP norm's scale folded into every expert's gate and up at once
        (they all read the block's input; the float router's columns take it too), then each expert's down
        scaled through its up where the activation allows it (ExpertsSpec.down_scales_through_up). An empty tuple
        for a dense family."""
        if self.experts is None:
            return ()
        x, block = self.experts, self.experts.block
        inputs = len(x.inputs)
        gate_up = tuple(n for e in range(num_experts) for n in x.linears_of(e)[:inputs])
        joint = LinearGroup(f"{block}.{x.experts}.gate_up", gate_up, feeder=self.norms.mlp_in, feeder_is_norm=True,
                            inspect=block)
        if not x.down_scales_through_up:
            return (joint,)
        downs = tuple(LinearGroup(f"{x.expert(e)}.down", (x.linears_of(e)[2],), feeder=x.linears_of(e)[1],
                                  feeder_is_norm=False, inspect=x.linears_of(e)[2], gate=x.linears_of(e)[0])
                      for e in range(num_experts))
        return (joint, *downs)

    def awq_groups(self, config) -> tuple[LinearGroup, ...]:
        """Every group AWQ may scale in a layer: the dense ones, then the experts'."""
        moe = moe_shape(self, config)
        return self.groups + self.expert_awq_groups(moe.num_experts if moe else 0)

    def float_linears(self) -> tuple[str, ...]:
        """Linears kept float by design, relative to the layer (the router: its errors move tokens to other
        experts, and it is tiny). Named in each checkpoint's list of modules not to quantize."""
        return (self.experts.router_path,) if self.experts else ()

    def dims_of(self, linear: str) -> tuple[str, str] | None:
        """The config dimensions (out, in) of a linear relative to the layer; None for one the spec does not know."""
        if linear in self.dims:
            return self.dims[linear]
        parsed = self.experts.parse(linear) if self.experts else None
        return EXPERT_DIMS[parsed[1]] if parsed else None

    def order_of(self, linear: str) -> tuple[int, int]:
        """Sort key of a linear within its layer: the dense ones in spec order, then experts by index and role."""
        if linear in self.linears:
            return (self.linears.index(linear), 0)
        parsed = self.experts.parse(linear) if self.experts else None
        if parsed is None:
            return (len(self.linears) + 1, 0)
        leaf = linear.rpartition(".")[2]
        per_expert = self.experts.projections
        return (len(self.linears), len(per_expert) * parsed[0] + per_expert.index(leaf))


def _llama_groups(mlp_in: str = "post_attention_layernorm", mlp: bool = True) -> tuple[LinearGroup, ...]:
    attention = (
        LinearGroup("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    feeder="input_layernorm", feeder_is_norm=True, inspect="self_attn", fused="self_attn.qkv_proj"),
        LinearGroup("o", ("self_attn.o_proj",), feeder="self_attn.v_proj", feeder_is_norm=False,
                    inspect="self_attn.o_proj", feeder_repeats_kv=True),
    )
    if not mlp:
        return attention
    return attention + (
        LinearGroup("gate_up", ("mlp.gate_proj", "mlp.up_proj"),
                    feeder=mlp_in, feeder_is_norm=True, inspect="mlp", fused="mlp.gate_up_proj"),
        LinearGroup("down", ("mlp.down_proj",), feeder="mlp.up_proj", feeder_is_norm=False, inspect="mlp.down_proj",
                    gate="mlp.gate_proj"),
    )


# Phi-3 / Phi-4: q/k/v and gate/up are stored fused (as vLLM runs them); AWQ scales o and down through the tail
# rows of the fused feeder
_PHI3_GROUPS = (
    LinearGroup("qkv", ("self_attn.qkv_proj",), feeder="input_layernorm", feeder_is_norm=True, inspect="self_attn"),
    LinearGroup("o", ("self_attn.o_proj",), feeder="self_attn.qkv_proj", feeder_is_norm=False,
                inspect="self_attn.o_proj", feeder_repeats_kv=True, feeder_tail=True),
    LinearGroup("gate_up", ("mlp.gate_up_proj",), feeder="post_attention_layernorm", feeder_is_norm=True,
                inspect="mlp"),
    LinearGroup("down", ("mlp.down_proj",), feeder="mlp.gate_up_proj", feeder_is_norm=False,
                inspect="mlp.down_proj", feeder_tail=True, gate="mlp.gate_up_proj"),
)
_PHI3_DIMS = {"self_attn.qkv_proj": ("qkv", "hidden"), "self_attn.o_proj": ("hidden", "q"),
              "mlp.gate_up_proj": ("2intermediate", "hidden"), "mlp.down_proj": ("hidden", "intermediate")}
_GEMMA3_NORMS = LayerNorms(mlp_in="pre_feedforward_layernorm", attn_out="post_attention_layernorm",
                           mlp_out="post_feedforward_layernorm", offset=1.0)


def _family(family: str, architectures: tuple[str, ...], **kw) -> ArchSpec:
    kw.setdefault("groups", _llama_groups())
    return ArchSpec(family=family, architectures=architectures, layers="model.layers", embed="model.embed_tokens",
                    final_norm="model.norm", lm_head="lm_head", **kw)


SPECS: tuple[ArchSpec, ...] = (
    _family("llama", ("LlamaForCausalLM",)),
    _family("mistral", ("MistralForCausalLM",)),
    _family("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True),
    _family("qwen3", ("Qwen3ForCausalLM",), qk_norm=True),
    _family("phi3", ("Phi3ForCausalLM",), groups=_PHI3_GROUPS, dims=_PHI3_DIMS),
    _family("gemma3", ("Gemma3ForCausalLM",), qk_norm=True, norms=_GEMMA3_NORMS, embed_scale=True,
            groups=_llama_groups(mlp_in=_GEMMA3_NORMS.mlp_in)),
    _family("mixtral", ("MixtralForCausalLM",), groups=_llama_groups(mlp=False),
            experts=ExpertsSpec(block="block_sparse_moe", hf_attr="mlp", gate="w1", up="w3", down="w2",
                                renormalize=True)),
    _family("qwen3_moe", ("Qwen3MoeForCausalLM",), qk_norm=True, groups=_llama_groups(mlp=False),
            experts=ExpertsSpec(block="mlp", hf_attr="mlp", gate="gate_proj", up="up_proj", down="down_proj")),
    # gpt-oss: softmax over the top-k router logits, which is the full softmax's top k renormalized
    _family("gpt_oss", ("GptOssForCausalLM",), groups=_llama_groups(mlp=False), attn_sinks=True,
            experts=ExpertsSpec(block="mlp", hf_attr="mlp", gate="gate_up_proj", up="gate_up_proj",
                                down="down_proj", router="router", renormalize=True, stacked=True, returns_pair=True,
                                gate_up="gate_up_proj", bias=True, router_bias=True, act="swiglu_oai")),
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for s in SPECS for a in s.architectures)


def _get(config, key: str, default=None):
    """config[key] for a config dict, getattr for a transformers config."""
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return default if value is None else value


def spec_for(config) -> ArchSpec:
    """The spec for a transformers config (or a dict with 'architectures')."""
    arch = (_get(config, "architectures") or [None])[0]
    for spec in SPECS:
        if arch in spec.architectures:
            if spec.experts is not None:
                _check_all_layers_sparse(config)
            return spec
    raise QuantkitError(
        f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _check_all_layers_sparse(config) -> None:
    """Qwen3-MoE may run some layers with a dense MLP (mlp_only_layers, decoder_sparse_step > 1); the specs
    describe one MoE layout for every layer, so such configs are refused rather than misread."""
    if _get(config, "mlp_only_layers") or int(_get(config, "decoder_sparse_step", 1)) != 1:
        raise QuantkitError("MoE models with dense MLP layers (mlp_only_layers, decoder_sparse_step > 1) "
                            "are not supported")
    if _get(config, "shared_expert_intermediate_size"):
        raise QuantkitError("MoE models with shared experts are not supported")


def moe_shape(spec: ArchSpec, config) -> MoEShape | None:
    """The MoE numbers of an MoE family's config (transformers 5 calls Qwen3-MoE's expert count
    num_local_experts, earlier ones num_experts); None for a dense family."""
    if spec.experts is None:
        return None
    experts = _get(config, "num_local_experts") or _get(config, "num_experts")
    intermediate = _get(config, "moe_intermediate_size") or _get(config, "intermediate_size")
    renorm = spec.experts.renormalize
    if renorm is None:
        renorm = bool(_get(config, "norm_topk_prob", False))
    return MoEShape(int(experts), int(_get(config, "num_experts_per_tok")), int(intermediate), renorm)


def config_dims(config) -> dict[str, int]:
    """The widths named in ArchSpec.dims, from a transformers config or config dict."""
    cfg = config.get("text_config", config) if isinstance(config, dict) else config
    hidden = int(_get(cfg, "hidden_size"))
    heads, kv_heads = head_counts(cfg)
    head_dim = int(_get(cfg, "head_dim") or hidden // heads)
    inter = int(_get(cfg, "intermediate_size"))
    dims = {"hidden": hidden, "intermediate": inter, "2intermediate": 2 * inter, "q": heads * head_dim,
            "kv": kv_heads * head_dim, "qkv": (heads + 2 * kv_heads) * head_dim}
    expert_inter = _get(cfg, "moe_intermediate_size") or inter
    dims["expert_intermediate"], dims["2expert_intermediate"] = int(expert_inter), 2 * int(expert_inter)
    return dims


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
    heads = int(_get(model_config, "num_attention_heads"))
    return heads, int(_get(model_config, "num_key_value_heads") or heads)


def get_submodule(root, path: str):
    """root.a.b.c for path 'a.b.c'."""
    mod = root
    for part in path.split("."):
        mod = getattr(mod, part)
    return mod
