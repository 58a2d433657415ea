"""The model runner: owns the decoder and the KV cache tensors, turns a SchedulerOutput into one forward.

Per layer the cache is a pair key/value [num_blocks, block_size, kv_heads, head_dim] in the
model dtype (on CPU, in transparent huge pages where granted: kv_tensors); with swap space, a CPU pair of the same
shape with `num_swap_blocks` blocks.
"""

from __future__ import annotations

import torch

from quantkit.engine.attention import build_metadata, use_cpu_kernel
from quantkit.engine.decoder import Decoder
from quantkit.engine.huge_pages import thp_unavailable, zeros_in_huge_pages
from quantkit.engine.scheduler import ScheduledChunk, SchedulerOutput
from quantkit.model.prompt_rows import PromptRows, prompt_rows


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, keys and values."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def kv_tensors(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, count: int,
               huge_pages: bool) -> list[torch.Tensor]:
    """`count` zeroed cache tensors of `shape`: on CPU with `huge_pages` (EngineConfig.cpu_huge_pages) in transparent
    huge pages where Linux grants them (decode attention at the 1B shape over 8 and 32 sequences, blocks scattered as
    the pool hands them out: 1.15x; docs/BENCHMARKS.md "the KV cache in transparent huge pages"), else torch's."""
    if huge_pages and device.type == "cpu" and thp_unavailable() is None:
        return zeros_in_huge_pages(shape, dtype, count)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]


class ModelRunner:
    def __init__(self, model: Decoder, num_blocks: int, block_size: int, num_swap_blocks: int,
                 dtype: torch.dtype, device: torch.device, huge_pages: bool = False):
        s = model.shape
        # The C++ CPU kernels load here (compiled on a machine's first use, or after their sources moved),
        # while a server's /health still answers 503: not inside the first request's step.
        use_cpu_kernel(device, dtype)
        self.model = model
        # some linear runs a step's prompt rows through another kernel (EngineConfig.cpu_int8_prefill): say which
        self.names_prompt_rows = any(getattr(m, "prompt_q8", None) is not None for m in model.modules())
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        shape = (num_blocks, block_size, s.num_kv_heads, s.head_dim)
        caches = kv_tensors(shape, dtype, device, 2 * s.num_layers, huge_pages)
        self.kv_caches = list(zip(caches[::2], caches[1::2]))
        swap_shape = (num_swap_blocks, *shape[1:])
        pin = device.type == "cuda"
        self.swap_caches = [(torch.zeros(swap_shape, dtype=dtype, pin_memory=pin),
                             torch.zeros(swap_shape, dtype=dtype, pin_memory=pin))
                            for _ in range(s.num_layers)] if num_swap_blocks else []

    def _copy_blocks(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs])
        dst = torch.tensor([b for _, b in pairs])
        for dev, cpu in zip(self.kv_caches, self.swap_caches):
            for d, c in zip(dev, cpu):
                if to_cpu:
                    c[dst] = d[src.to(self.device)].cpu()
                else:
                    d[dst.to(self.device)] = c[src].to(self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Swap blocks out, then in, then run the forward. Returns logits [the sampling chunks' rows (one each, or
        1 + drafts with speculative decoding) + prompt logprob rows, vocab] fp32, and the final-normed hidden states
        [the pooling spans' rows, hidden] fp32 (None when no embedding request runs in the step)."""
        self._copy_blocks(out.blocks_to_swap_out, to_cpu=True)
        self._copy_blocks(out.blocks_to_swap_in, to_cpu=False)
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        for chunk in out.chunks:
            known = chunk.num_tokens - len(chunk.drafts)
            ids.extend(chunk.request.all_token_ids[chunk.start:chunk.start + known])
            ids.extend(chunk.drafts)
            positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
            rows.extend(range(len(ids) - chunk.num_sample_rows, len(ids)))  # the last known token's, the drafts
        rows.extend(out.prompt_logprob_rows())  # after the sampled rows: prompt logprobs
        meta = build_metadata([c.start + c.num_tokens for c in out.chunks], [c.num_tokens for c in out.chunks],
                              [c.block_ids for c in out.chunks], self.block_size, self.device, self.dtype,
                              out.block_table)
        pooled = [r for _, span in out.pooling_spans() for r in span]
        dev = self.device
        prompt = PromptRows.of_spans([(c.num_tokens, is_prompt(c)) for c in out.chunks]) \
            if self.names_prompt_rows else None
        with prompt_rows(prompt):
            return self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.kv_caches,
                              meta, torch.tensor(rows, dtype=torch.int64, device=dev),
                              torch.tensor(pooled, dtype=torch.int64, device=dev) if pooled else None)


def is_prompt(chunk: ScheduledChunk) -> bool:
    """A chunk of a prompt (or of a preempted request's recompute): more than one token and no drafts. A decode is
    one token, a speculative one its token and drafts."""
    return chunk.num_tokens > 1 and not chunk.drafts
