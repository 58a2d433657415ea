"""How many KV blocks the pool gets, and the start-up refusal when one request cannot fit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.engine.config import GiB, EngineConfig
from quantkit.errors import QuantkitError

DEFAULT_CPU_KV_BYTES = GiB
MiB = 1024**2


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    block_bytes: int
    num_swap_blocks: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        mib = self.num_blocks * self.block_bytes / MiB
        swap = f", swap {self.num_swap_blocks} blocks" if self.num_swap_blocks else ""
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.capacity_tokens} tokens "
                f"({mib:.1f} MiB){swap}")


def plan_kv(cfg: EngineConfig, block_bytes: int, max_model_len: int, device: torch.device) -> KVPlan:
    """Blocks from num_kv_blocks, else from kv_cache_memory (CPU) or gpu_memory_utilization (GPU)."""
    per_seq = -(-max_model_len // cfg.block_size)
    if cfg.num_kv_blocks is not None:
        num_blocks = cfg.num_kv_blocks
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * cfg.gpu_memory_utilization) - (total - free)  # what weights etc. left
        num_blocks = max(0, budget) // block_bytes
    elif cfg.kv_cache_memory is not None:
        num_blocks = cfg.kv_cache_memory // block_bytes
    else:  # default: 1 GiB, but no more than every sequence at full length needs
        num_blocks = min(DEFAULT_CPU_KV_BYTES // block_bytes, cfg.max_num_seqs * per_seq)
    if num_blocks < per_seq:
        raise QuantkitError(
            f"KV pool too small: {num_blocks} blocks of {cfg.block_size} tokens ({num_blocks * cfg.block_size} tokens, "
            f"{num_blocks * block_bytes / MiB:.1f} MiB) cannot hold one request of max_model_len={max_model_len} "
            f"(needs {per_seq} blocks, {per_seq * block_bytes / MiB:.1f} MiB); give more KV memory or lower max_model_len"
        )
    swap_blocks = int(cfg.swap_space * GiB) // block_bytes
    return KVPlan(num_blocks, cfg.block_size, block_bytes, swap_blocks)
