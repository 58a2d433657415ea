"""The scheduler: one token budget per step, FCFS, chunked prefill, preemption of the newest request.

As in vLLM's v1 core there is no prefill or decode phase: every request tracks
`num_computed_tokens`, and each step gives running requests (oldest first), then waiting ones,
up to `num_tokens - num_computed_tokens` tokens within the budget. A long prompt is therefore
prefilled in chunks beside running decodes, and a prefix hit simply starts a request with
computed tokens. When blocks run out the newest running request is preempted: by recompute
(its blocks are freed and it starts over) or, with swap space, by moving its blocks to CPU.

Filling the pool (where we differ from vLLM, which waits until a whole chunk fits): a prompt chunk
that does not fit is cut to the free blocks, less one block for each running decode that will
need a new block next step; the head of the queue is admitted that way too. A prefilling request
that cannot get a single token waits a step, holding its blocks. When a decode needs a block and
the newest running request is still prefilling, that request gives back its last block (and
recomputes those tokens later) rather than losing all its work.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from quantkit.engine.kv_cache_manager import KVCacheManager
from quantkit.engine.pooling import pooled_rows
from quantkit.engine.request import Request, RequestStatus
from quantkit.engine.swap import SwapSpace


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (== num_computed_tokens before the step)
    num_tokens: int
    block_ids: list[int]
    samples: bool  # the chunk reaches the end of the known tokens: its last logits are sampled
    drafts: list[int] = field(default_factory=list)  # speculative tokens after the known ones (verified, not known)

    @property
    def num_sample_rows(self) -> int:
        """Rows of logits this chunk hands to sampling: the last known token's, and one per draft."""
        return 1 + len(self.drafts) if self.samples else 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    preempted: list[str] = field(default_factory=list)
    block_table: torch.Tensor | None = None  # int32 [chunks, most blocks]: the chunks' block ids, zero-padded

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def prompt_logprob_spans(self) -> list[tuple[ScheduledChunk, int, int]]:
        """(chunk, first row in the step's flat tokens, count) for chunks of requests that want prompt
        logprobs: the chunk's positions before the last prompt token, whose logits score the next prompt token."""
        spans, offset = [], 0
        for c in self.chunks:
            if c.request.params.prompt_logprobs is not None:
                count = min(c.start + c.num_tokens, c.request.num_prompt_tokens - 1) - c.start
                if count > 0:
                    spans.append((c, offset, count))
            offset += c.num_tokens
        return spans

    def pooling_spans(self) -> list[tuple[ScheduledChunk, range]]:
        """(chunk, its rows in the step's flat tokens) for chunks of embedding requests: the positions their pooling
        reads (every one for mean; the last prompt token's, in the chunk that holds it, for last)."""
        spans, offset = [], 0
        for c in self.chunks:
            pool = c.request.pooling
            if pool is not None:
                rows = pooled_rows(pool.params, c.start, c.num_tokens, c.request.num_prompt_tokens)
                spans.append((c, range(offset + rows.start - c.start, offset + rows.stop - c.start) if rows else rows))
            offset += c.num_tokens
        return spans

    def prompt_logprob_rows(self) -> list[int]:
        """Rows (in the step's flat tokens) whose logits the model runner returns after the sampled ones."""
        return [offset + k for _, offset, count in self.prompt_logprob_spans() for k in range(count)]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 swap: SwapSpace | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.swap = swap
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_swap_outs = 0  # preemptions that moved blocks to CPU instead of dropping them
        self._shrunk = False  # a prefill gave back a block this step

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.chunks and out.preempted and self.running:
            # a decode preempted itself after older prefills had paused: they may fit in its blocks now
            budget = self._schedule_running(out, self.max_num_batched_tokens)
        while not out.chunks and self.running:
            # every running request is a prefill waiting for room that only they hold: the newest gives way
            self._preempt(self.running.pop(), out)
            budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted and not self._shrunk:  # the pool is short this step: admit nobody
            self._schedule_waiting(out, budget)
        if out.chunks:
            out.block_table = self.kv.block_table([c.request.request_id for c in out.chunks])
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self._shrunk = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n == 1 and req.draft_token_ids and budget > 1:  # a decode with drafts: all of them, if they fit
                drafts = req.draft_token_ids[:budget - 1]
                if self.kv.allocate_slots(req, 1 + len(drafts)) is not None:
                    out.chunks.append(self._chunk(req, 1 + len(drafts), drafts))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue  # without room for them, a plain decode below
            if n > 1:  # a prompt chunk (or a recompute): cut to what fits, or wait a step
                n = min(n, self.kv.num_fitting_tokens(req, reserve_blocks=self._decode_reserve(i)))
                if n == 0:
                    i += 1
                    continue
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running[-1]  # the newest request
                if victim is not req and victim.num_computed_tokens < victim.num_tokens - 1 \
                        and len(self.kv.block_ids(victim.request_id)) > 1:
                    self.kv.release_tail_block(victim)  # a prefill gives back its last block
                    self._shrunk = True
                    continue
                self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    return budget
            out.chunks.append(self._chunk(req, n))
            budget -= n
            i += 1
        return budget

    def _decode_reserve(self, first: int = 0) -> int:
        """Blocks that running decodes (from index `first` on) will ask for next step: those whose
        blocks are full once this step's token is in."""
        bs = self.kv.block_size
        return sum(1 for r in self.running[first:]
                   if r.num_tokens - r.num_computed_tokens == 1
                   and r.num_tokens >= len(self.kv.block_ids(r.request_id)) * bs)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if req.swapped_blocks is not None:
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                fresh = self.kv.allocate_slots(req, n)
                if fresh is None:
                    return
                cpu = req.swapped_blocks
                out.blocks_to_swap_in.extend(zip(cpu, fresh.block_ids()[:len(cpu)]))
                self.swap.release(cpu)
                req.swapped_blocks = None
            else:
                hits, num_hit = self.kv.get_computed_blocks(req)
                n = min(req.num_tokens - num_hit, budget)
                reserve = self._decode_reserve()
                if n > 1 and self.kv.num_fitting_tokens(req, hits, reserve) < n:
                    # admit with what fits: the prefix hits that can be revived, then a cut chunk
                    hits = self.kv.affordable_hits(hits, reserve)
                    num_hit = len(hits) * self.kv.block_size
                    n = min(req.num_tokens - num_hit, budget, self.kv.num_fitting_tokens(req, hits, reserve))
                    if n == 0:
                        return
                if self.kv.allocate_slots(req, n, hits) is None:
                    return
                self.kv.record_prefix_lookup(req.num_tokens, num_hit)
                req.num_computed_tokens = num_hit
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(self._chunk(req, n))
            budget -= n

    def _chunk(self, req: Request, n: int, drafts: list[int] | None = None) -> ScheduledChunk:
        start, drafts = req.num_computed_tokens, drafts or []
        return ScheduledChunk(req, start, n, self.kv.block_ids(req.request_id),
                              req.samples and start + n - len(drafts) == req.num_tokens, list(drafts))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Put `req` back at the head of the waiting queue, its KV swapped to CPU or dropped."""
        device_blocks = self.kv.block_ids(req.request_id)
        needed = -(-req.num_computed_tokens // self.kv.block_size)
        cpu = self.swap.allocate(needed) if self.swap is not None and needed > 0 else None
        if cpu is not None:
            out.blocks_to_swap_out.extend(zip(device_blocks[:needed], cpu))
            req.swapped_blocks = cpu
            self.num_swap_outs += 1
        else:
            req.num_computed_tokens = 0
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput) -> None:
        """Advance each scheduled request's computed tokens (sampled tokens are appended by the engine; the drafts it
        keeps add to the computed ones then)."""
        for chunk in out.chunks:
            chunk.request.num_computed_tokens = chunk.start + chunk.num_tokens - len(chunk.drafts)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End `req` in any state (running, waiting, preempted, swapped): every KV and swap block it holds
        goes back now. An abort is `finish(req, "abort")`."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.swapped_blocks is not None:
            self.swap.release(req.swapped_blocks)
            req.swapped_blocks = None
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.kv.free(req)

    @property
    def num_swapped(self) -> int:
        return sum(1 for r in self.waiting if r.swapped_blocks is not None)
