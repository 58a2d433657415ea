"""Deployment arithmetic from config.json alone: weight bytes (fp16 and INT-n with scales and zeros),
KV bytes per token, the tokens and full-length sequences that fit, per GPU under tensor parallelism.

  KV bytes / token / GPU = 2 (K and V) x layers x kv_heads_per_gpu x head_dim x kv dtype bytes
  KV budget / GPU        = gpu_memory x utilization - weight bytes / GPU
  KV tokens / GPU        = floor(budget / (block_size x KV bytes / token)) x block_size
as quantkit's engine sizes its pool on a GPU (engine/kv_sizing.py plan_kv) and vLLM sizes its own,
less the activation and CUDA-graph memory vLLM profiles at start-up, which no config file can tell.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from quantkit.errors import QuantkitError
from quantkit.format.arch import LayerNorms, moe_shape

GiB = 1024**3
KV_DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "auto": 2,
                  "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
         "kib": 1024, "mib": 1024**2, "gib": GiB, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB', '1.5TiB', '123456' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*", text.lower())
    if not m:
        raise QuantkitError(f"cannot read a size from {text!r} (e.g. 80GiB, 40GB)")
    unit = m.group(2) or ""
    if unit and not unit.endswith("b"):
        unit += "b"
    return int(float(m.group(1)) * UNITS[unit])


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that its memory depends on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    max_position_embeddings: int
    experts: int = 0  # an MoE's experts per layer (0: a dense MLP)
    top_k: int = 0  # experts a token runs through
    expert_intermediate: int = 0
    norms_per_layer: int = 2  # hidden-wide norms per layer (Gemma 3: four)
    qk_norm: bool = False  # per-head q and k norms [head_dim] each
    o_bias: bool = False  # o_proj has a bias (config.attention_bias)
    sinks: bool = False  # a logit per attention head (gpt-oss)
    moe_biases: bool = False  # the router and every expert linear have biases (gpt-oss)

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        c = config.get("text_config", config)
        spec = _spec(config)
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            moe = moe_shape(spec, c) if spec is not None else None
            norms = spec.norms if spec is not None else LayerNorms()
            return cls(int(c["num_hidden_layers"]), hidden, int(c["intermediate_size"]), heads,
                       int(c.get("num_key_value_heads") or heads), int(c.get("head_dim") or hidden // heads),
                       int(c["vocab_size"]), bool(c.get("tie_word_embeddings", False)),
                       bool(c.get("attention_bias", False)) or c.get("model_type") == "qwen2",
                       int(c.get("max_position_embeddings") or 4096),
                       moe.num_experts if moe else 0, moe.top_k if moe else 0, moe.intermediate if moe else 0,
                       sum(n is not None for n in (norms.attn_in, norms.mlp_in, norms.attn_out, norms.mlp_out)),
                       bool(spec is not None and spec.qk_norm), bool(c.get("attention_bias", False)),
                       bool(spec is not None and spec.attn_sinks),
                       bool(moe and spec.experts.bias and spec.experts.router_bias))
        except (KeyError, TypeError, ValueError) as exc:
            raise QuantkitError(f"config.json lacks what a plan needs ({exc})") from exc

    def attention_linears(self) -> list[tuple[int, int]]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(q, self.hidden), (kv, self.hidden), (kv, self.hidden), (self.hidden, q)]

    def expert_linears(self) -> list[tuple[int, int]]:
        """(out, in) of one expert's gate, up and down (an MoE), or of the dense MLP's."""
        h, i = self.hidden, self.expert_intermediate if self.experts else self.intermediate
        return [(i, h), (i, h), (h, i)]

    def linears(self) -> list[tuple[int, int]]:
        """(out, in) of each quantizable linear of one decoder layer (every expert's, for an MoE)."""
        return self.attention_linears() + self.expert_linears() * max(1, self.experts)

    def expert_bias_params(self) -> int:
        """One expert's bias entries where its linears have them (gate, up, down outputs)."""
        return sum(n for n, _ in self.expert_linears()) * self.moe_biases

    def other_params(self) -> int:
        """Parameters that stay in fp16 whatever the weights: embeddings, lm_head, norms, biases, MoE routers."""
        per_layer = self.norms_per_layer * self.hidden + 2 * self.head_dim * self.qk_norm \
            + (self.heads + 2 * self.kv_heads) * self.head_dim * self.qkv_bias + self.experts * self.hidden \
            + self.hidden * self.o_bias + self.heads * self.sinks \
            + self.experts * (1 + self.expert_bias_params()) * self.moe_biases
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * per_layer + self.hidden


def _spec(config: dict):
    """The family's spec where quantkit knows the architecture (norms, experts); None for the others, which are
    planned as a Llama-style dense model."""
    from quantkit.format.arch import spec_for

    try:
        return spec_for(config)
    except QuantkitError:
        return None


def layer_linear_bytes(shape: ModelShape, bits: int | None, group_size: int = 128) -> int:
    """The linears of one decoder layer; bits None: fp16. Packed: codes + fp16 scales + packed zeros per group."""
    return linear_bytes(shape.linears(), bits, group_size)


def weight_bytes(shape: ModelShape, bits: int | None, group_size: int = 128) -> int:
    """All weights; embeddings, lm_head and norms stay fp16."""
    return shape.layers * layer_linear_bytes(shape, bits, group_size) + 2 * shape.other_params()


def linear_bytes(linears: list[tuple[int, int]], bits: int | None, group_size: int = 128) -> int:
    """Bytes of these linears (out, in); bits None: fp16. Packed: codes + fp16 scales + packed zeros per group."""
    total = 0
    for n, k in linears:
        if bits is None:
            total += 2 * n * k
        else:
            groups = 1 if group_size == -1 else -(-k // group_size)
            total += n * k * bits // 8 + groups * n * 2 + groups * n * bits // 8
    return total


@dataclass(frozen=True)
class MoEPlan:
    """An MoE's parameters: all of them against those one token runs through (top_k of each layer's experts), and
    the experts' weights, which are most of the model."""

    experts: int
    top_k: int
    total_params: int
    active_params: int
    expert_bytes_fp16: int  # every layer's experts
    expert_bytes_packed: int

    @classmethod
    def of(cls, shape: ModelShape, bits: int, group_size: int) -> "MoEPlan | None":
        if not shape.experts:
            return None
        one_expert = sum(n * k for n, k in shape.expert_linears()) + shape.expert_bias_params()
        total = shape.layers * sum(n * k for n, k in shape.linears()) + shape.other_params()
        idle = shape.layers * (shape.experts - shape.top_k) * one_expert
        every = shape.expert_linears() * shape.experts
        return cls(shape.experts, shape.top_k, total, total - idle, shape.layers * linear_bytes(every, None),
                   shape.layers * linear_bytes(every, bits, group_size))


@dataclass(frozen=True)
class PlanColumn:
    """One weight precision's deployment, per GPU."""

    label: str
    weight_bytes_total: int
    weight_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_blocks_per_gpu: int
    kv_tokens: int
    concurrent_sequences: int  # whole sequences of max_model_len tokens: a part of one serves no request
    fits: bool


@dataclass(frozen=True)
class DeploymentPlan:
    model: str
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    max_model_len: int
    tp: int
    kv_dtype: str
    block_size: int
    bits: int
    group_size: int
    shape: ModelShape
    columns: tuple[PlanColumn, ...]
    notes: tuple[str, ...]
    moe: MoEPlan | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, tp: int = 1) -> int:
    """2 x layers x kv_heads (on one GPU) x head_dim x bytes; KV heads are replicated when tp > kv_heads."""
    return 2 * shape.layers * kv_heads_per_gpu(shape, tp) * shape.head_dim * KV_DTYPE_BYTES[kv_dtype]


def kv_heads_per_gpu(shape: ModelShape, tp: int) -> int:
    return max(1, shape.kv_heads // tp)


def plan_column(label: str, shape: ModelShape, weights: int, budget_bytes: int, tp: int, kv_dtype: str,
                block_size: int, max_model_len: int, kv_cache_memory: int | None = None) -> PlanColumn:
    """`kv_cache_memory` fixes the KV budget per GPU (vLLM's --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE);
    otherwise the KV cache gets what the weights leave of `budget_bytes`."""
    per_gpu = -(-weights // tp)
    kv_budget = budget_bytes - per_gpu if kv_cache_memory is None else kv_cache_memory
    per_token = kv_bytes_per_token(shape, kv_dtype, tp)
    blocks = max(0, kv_budget) // (per_token * block_size)
    tokens = blocks * block_size
    return PlanColumn(label, weights, per_gpu, kv_budget, per_token, blocks, tokens, tokens // max_model_len,
                      tokens >= max_model_len)


def make_plan(model: str, config: dict, gpu_memory: int, utilization: float = 0.9, max_model_len: int | None = None,
              bits: int = 4, group_size: int = 128, kv_dtype: str = "auto", tp: int = 1,
              block_size: int = 16, kv_cache_memory: int | None = None) -> DeploymentPlan:
    if kv_dtype not in KV_DTYPE_BYTES:
        raise QuantkitError(f"unknown --kv-dtype {kv_dtype!r}; expected one of {', '.join(KV_DTYPE_BYTES)}")
    if not 0 < utilization <= 1:
        raise QuantkitError(f"--gpu-memory-utilization must be in (0, 1] (got {utilization})")
    if kv_cache_memory is not None and kv_cache_memory <= 0:
        raise QuantkitError(f"--kv-cache-memory must be positive (got {kv_cache_memory} bytes)")
    if tp < 1 or bits not in (2, 3, 4, 8) or gpu_memory <= 0:
        raise QuantkitError("--tp must be >= 1, --bits one of 2, 3, 4, 8, and --gpu-memory positive")
    shape = ModelShape.from_config(config)
    max_len = max_model_len or shape.max_position_embeddings
    notes = []
    if max_len > shape.max_position_embeddings:
        notes.append(f"--max-model-len {max_len} is past this model's own limit of {shape.max_position_embeddings} "
                     f"positions (max_position_embeddings in config.json): vLLM and quantkit refuse to serve it; the "
                     f"figures below assume sequences of {max_len} tokens all the same")
    if shape.heads % tp:
        notes.append(f"{shape.heads} attention heads do not split over --tp {tp}: vLLM refuses this degree")
    if shape.kv_heads < tp:
        notes.append(f"{shape.kv_heads} KV heads < --tp {tp}: each GPU holds a replica of one KV head")
    budget = int(gpu_memory * utilization)
    cols = (plan_column("fp16", shape, weight_bytes(shape, None), budget, tp, kv_dtype, block_size, max_len,
                        kv_cache_memory),
            plan_column(f"INT{bits} g{group_size}", shape, weight_bytes(shape, bits, group_size), budget, tp,
                        kv_dtype, block_size, max_len, kv_cache_memory))
    notes.append("vLLM also holds activation and CUDA-graph memory it profiles at start-up: expect somewhat fewer tokens")
    return DeploymentPlan(model, gpu_memory, utilization, max_len, tp, kv_dtype, block_size, bits, group_size,
                          shape, cols, tuple(notes), MoEPlan.of(shape, bits, group_size))
