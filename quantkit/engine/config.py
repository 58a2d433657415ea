"""EngineConfig: every engine knob in one validated object, built at the API/CLI edge."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.devices import check_device_name
from quantkit.engine.sampling_params import MAX_LOGPROBS
from quantkit.engine.spec_decode import SpeculativeConfig
from quantkit.errors import QuantkitError

DTYPES = ("auto", "float32", "bfloat16", "float16")
GiB = 1024**3


@dataclass(slots=True)
class EngineConfig:
    model: str
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # set directly, or sized from the memory knobs below
    kv_cache_memory: int | None = None  # bytes for the KV pool on CPU (None: 1 GiB, capped at what is usable)
    gpu_memory_utilization: float = 0.9  # on GPU: fraction of total memory for weights + KV pool
    swap_space: float = 0.0  # GiB of CPU memory for preempted requests' blocks; 0: preempt by recompute
    dtype: str = "auto"  # auto: float16 on GPU; on CPU bfloat16 where it computes natively, else float32
    device: str = "auto"
    seed: int = 0
    num_threads: int | None = None  # CPU: torch intra-op threads (None: leave torch's setting)
    # CPU, bf16, 4-bit checkpoints: the 4-bit linears round the activations to int8 per row and group and run
    # the W4A8 kernel (AVX-512 VNNI), as llama.cpp's Q8 activations, prefill chunks too except where AMX tiles
    # take them (kernels/linear_choice.py); off: W4A16, the checkpoint's arithmetic
    cpu_int8_activations: bool = False
    # CPU, 4-bit checkpoints: the prompt tokens alone run W4A8 (the int8 arithmetic above: about 1.5x the bf16
    # prefill speed where no AMX tiles are granted, 1.1-1.2x fp32's on AVX2), generated tokens W4A16. None (auto): on
    # where the W4A8 kernel for the dtype builds and, in bf16, no AMX tiles are granted
    # (engine/weights.int8_prefill_wanted); False: W4A16 throughout
    cpu_int8_prefill: bool | None = None
    # CPU, bf16: a float lm_head held in int8, symmetric per row and group of 128 columns (kernels/int8_cpu.py):
    # half the bytes a decode step reads for it. None (auto): on for checkpoints whose linears are quantized,
    # where the int8 kernel is built; False: the checkpoint's float head; True: also for float checkpoints
    cpu_int8_lm_head: bool | None = None
    # CPU, Linux: the weights moved into transparent huge pages once loaded and the KV cache allocated there
    # (engine/huge_pages.py): decode reads both faster (fewer TLB misses, the prefetcher not stopped every 4 KiB);
    # False: the allocator's pages
    cpu_huge_pages: bool = True
    # speculative decoding (vLLM's --speculative-config): n-gram prompt lookup, K drafts verified per step
    speculative_config: SpeculativeConfig | dict | None = None
    tokenizer: str | None = None  # a tokenizer folder or hub id other than the model's (vLLM's --tokenizer)
    max_logprobs: int = MAX_LOGPROBS  # the most logprobs (or prompt logprobs) a request may ask for; -1: the vocabulary (vLLM's)

    def __post_init__(self):
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise QuantkitError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise QuantkitError(f"max_model_len must be at least 2 (got {self.max_model_len})")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise QuantkitError(f"num_kv_blocks must be at least 1 (got {self.num_kv_blocks})")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise QuantkitError(f"kv_cache_memory must be a positive number of bytes (got {self.kv_cache_memory})")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise QuantkitError(f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.swap_space < 0:
            raise QuantkitError(f"swap_space must be >= 0 GiB (got {self.swap_space})")
        if self.max_logprobs < -1:
            raise QuantkitError(f"max_logprobs must be -1 (the vocabulary) or at least 0 (got {self.max_logprobs})")
        if self.num_threads is not None and self.num_threads < 1:
            raise QuantkitError(f"num_threads must be at least 1 (got {self.num_threads})")
        if self.dtype not in DTYPES:
            raise QuantkitError(f"unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        check_device_name(self.device)

    @property
    def preemption_mode(self) -> str:
        return "swap" if self.swap_space > 0 else "recompute"
