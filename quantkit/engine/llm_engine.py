"""LLMEngine: add requests, abort them, step. One step reads top to bottom: schedule, run the model,
sample, then update each request (logprobs, detokenize, check stops, free the finished), and hand
back an output for every request that changed."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import torch

from quantkit.engine.config import EngineConfig
from quantkit.engine.detokenizer import IncrementalDetokenizer, find_stop
from quantkit.engine.kv_cache_manager import KVCacheManager
from quantkit.engine.kv_sizing import plan_kv
from quantkit.engine.loaded_model import load_engine_model
from quantkit.engine.model_runner import ModelRunner, kv_block_bytes
from quantkit.engine.logprobs import check_logprobs_limit, logprob_dicts
from quantkit.engine.parallel_sampling import RequestGroup, child_id, child_params
from quantkit.engine.pooling import PoolingParams, PoolingState, pool_step, split_params
from quantkit.engine.request import Request, RequestOutput, RequestStatus
from quantkit.engine.sampler import Sampler
from quantkit.engine.sampling_params import SamplingParams
from quantkit.engine.scheduler import Scheduler, SchedulerOutput
from quantkit.engine.spec_decode import NgramIndex
from quantkit.engine.stats import EngineStats, StatsCollector, StepStats
from quantkit.engine.structured_outputs import GrammarMatchers
from quantkit.engine.swap import SwapSpace
from quantkit.engine.token_text import MAX_CONTEXT, TokenTexts
from quantkit.errors import QuantkitError

log = logging.getLogger("quantkit.engine")


def non_finite_rows(logits: torch.Tensor) -> list[int]:
    """Rows of logits [R, V] that hold NaN or inf (a checkpoint whose scales or weights are corrupt)."""
    # The common case: the row sums are finite, which a NaN or an inf anywhere in a row never leaves them (one pass,
    # 20x faster than torch.isfinite over [32, 128256]); a sum that overflows from finite logits takes the exact test.
    if bool(torch.isfinite(logits.sum(dim=-1)).all()):
        return []
    return (~torch.isfinite(logits).all(dim=-1)).nonzero().flatten().tolist()


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        loaded = load_engine_model(cfg)
        self.device, self.dtype, self.model, self.quant_info = loaded.device, loaded.dtype, loaded.model, \
            loaded.quant_info
        self.tokenizer, self.eos_ids, self.max_model_len = loaded.tokenizer, loaded.eos_ids, loaded.max_model_len
        self.huge_pages = loaded.huge_pages
        s = self.model.shape
        block_bytes = kv_block_bytes(s.num_layers, cfg.block_size, s.num_kv_heads, s.head_dim, self.dtype)
        self.kv_plan = plan_kv(cfg, block_bytes, self.max_model_len, self.device)
        self.kv = KVCacheManager(self.kv_plan.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        swap = SwapSpace(self.kv_plan.num_swap_blocks) if self.kv_plan.num_swap_blocks else None
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, swap)
        self.runner = ModelRunner(self.model, self.kv_plan.num_blocks, cfg.block_size,
                                  self.kv_plan.num_swap_blocks, self.dtype, self.device, cfg.cpu_huge_pages)
        self.swap = swap
        self.sampler = Sampler(cfg.seed, self.eos_ids)
        self.grammars = GrammarMatchers(self.tokenizer, s.vocab_size, self.eos_ids)
        self.collector = StatsCollector()
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._groups: dict[str, RequestGroup] = {}  # live user requests, by id
        self._group_of: dict[str, RequestGroup] = {}  # child (scheduler) request id -> its user request
        self._changed: dict[str, RequestGroup] = {}  # user requests with news for the next step's outputs
        self._token_texts = TokenTexts(self.tokenizer)  # logprobs' token texts, as vLLM writes them
        self._ids = itertools.count()
        self.last_step = StepStats()
        self.last_error: Exception | None = None  # what failed the last step, if it failed
        log.info(self.kv_plan.describe())

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (text or ids), checked; a bad prompt raises QuantkitError."""
        # verbose=False: the length check below says when a prompt is too long (no tokenizer "indexing errors")
        ids = list(prompt) if not isinstance(prompt, str) else (self.tokenizer(prompt, verbose=False).input_ids
                                                                if prompt else [])
        if not ids:
            raise QuantkitError("empty prompt")
        if len(ids) > self.max_model_len:
            raise QuantkitError(f"prompt has {len(ids)} tokens, more than max_model_len {self.max_model_len}")
        vocab = self.model.shape.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise QuantkitError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        return ids

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | PoolingParams,
                    request_id: str | None = None, arrival_time: float | None = None,
                    reject_bad_prompt: bool = False) -> str:
        """Queue a prompt (text or token ids) for `params.n` samples, or with PoolingParams for its embedding (the
        finished output's `embedding`). A bad prompt becomes a finished request with an error (its output comes
        with the next step), or with `reject_bad_prompt` raises QuantkitError and queues nothing. A live id raises
        QuantkitError."""
        params, pooling = split_params(params)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._groups:
            raise QuantkitError(f"request id {rid!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        try:
            check_logprobs_limit(params.logprobs, params.prompt_logprobs, self.cfg.max_logprobs,
                                 self.model.shape.vocab_size)
            ids, error = self.encode_prompt(prompt), None
            if params.structured_outputs is not None:  # a spec that does not compile is refused here, not mid-run
                self.grammars.compile(params.structured_outputs)
        except QuantkitError as e:
            if reject_bad_prompt:
                raise
            ids, error = ([] if text is not None else list(prompt)), str(e)
        children = [Request(child_id(rid, i, params.n), ids, child_params(params, i), self.cfg.block_size,
                            prompt=text, arrival_time=arrival,
                            pooling=None if pooling is None else PoolingState(pooling)) for i in range(params.n)]
        group = self._groups[rid] = RequestGroup(rid, text, ids, children)
        for child in children:
            self._group_of[child.request_id] = group
            if error:
                child.error = error
                self._finish(child, "error")
            else:
                self._detoks[child.request_id] = IncrementalDetokenizer(
                    self.tokenizer, ids, params.skip_special_tokens, params.spaces_between_special_tokens)
                self.scheduler.add_request(child)
        return rid

    def abort_request(self, request_id: str) -> bool:
        """End a request in any state; every KV and swap block it holds is free when this returns.
        Its output (finish_reason "abort") comes with the next step. False if unknown or already finished."""
        group = self._groups.get(request_id)
        if group is None or group.finished:
            return False
        for child in group.children:
            if not child.is_finished:
                self._finish(child, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._changed) or self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step; returns an output for every request that changed (new token, finished,
        aborted, failed), or with `finished_only` for those that finished (offline use: no outputs
        built for running requests). If the forward or the sampler raises, the requests of this step
        fail with the error (finish_reason "error") and the engine goes on; `last_error` keeps it."""
        out = self.scheduler.schedule()
        self.last_step = StepStats(out.num_tokens, len(self.scheduler.running), len(self.scheduler.waiting),
                                   sum(r.num_computed_tokens for r in self.scheduler.running) + out.num_tokens,
                                   self.kv.usage(),
                                   len(out.preempted))
        self.last_error = None
        if out.chunks:
            self.collector.iteration_tokens.observe(out.num_tokens)
            now = time.monotonic()
            for chunk in out.chunks:
                if chunk.request.metrics.first_scheduled_time is None:
                    chunk.request.metrics.first_scheduled_time = now
            try:
                logits, hidden = self.runner.execute(out)
                self.scheduler.update_from_output(out)
                self._postprocess(out, logits)
                for req in pool_step(out.pooling_spans(), hidden):  # embedding requests whose prompt has run
                    self._finish(req, "stop")
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the engine
                log.exception("engine step failed")
                self.last_error = exc
                self._fail_step(out, f"engine step failed: {type(exc).__name__}: {exc}")
        return self._take_outputs(finished_only)

    def _take_outputs(self, finished_only: bool) -> list[RequestOutput]:
        outs = []
        for group in self._changed.values():
            if group.finished or not finished_only:
                outs.append(group.output())
            if group.finished:
                del self._groups[group.request_id]
                for child in group.children:
                    self._group_of.pop(child.request_id, None)
        self._changed = {}
        return outs

    def _fail_step(self, out: SchedulerOutput, error: str) -> None:
        """Fail the step's requests (and those swapped out in it: their copy may be half done). Their
        cached blocks may hold half-written KV, so the prefix cache is dropped."""
        swapped = [r for r in self.scheduler.waiting if r.request_id in out.preempted and r.swapped_blocks]
        for req in [c.request for c in out.chunks] + swapped:
            if not req.is_finished:
                req.error = error
                self._finish(req, "error")
        self.kv.pool.reset_prefix_cache()

    def _postprocess(self, out: SchedulerOutput, logits: torch.Tensor) -> None:
        chunks = [c for c in out.chunks if c.samples]
        num_rows = sum(c.num_sample_rows for c in chunks)
        self._record_prompt_logprobs(out, logits[num_rows:])  # the rows after the sampled ones
        plain, plain_rows, row = [], [], 0
        for c in chunks:
            if c.drafts:
                self._verify(c, logits[row:row + c.num_sample_rows])
            else:
                plain.append(c.request)
                plain_rows.append(row)
            row += c.num_sample_rows
        if plain:  # the rows in place where they are the first ones (no speculation): a view, no copy
            self._sample(plain, logits[:len(plain)] if plain_rows[-1] == len(plain) - 1 else logits[plain_rows])
        if self.cfg.speculative_config is not None:
            self._propose([c.request for c in chunks])

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """One token for each request, from its row of logits [len(reqs), V]."""
        reqs, sampled = self._fail_non_finite(reqs, logits)  # raw logits: before any grammar's mask
        if not reqs:
            return
        ids, specs = [r.request_id for r in reqs], [r.params.structured_outputs for r in reqs]
        tokens = self.sampler.sample(self.grammars.masked(sampled, ids, specs), ids, [r.params for r in reqs],
                                     [r.all_token_ids for r in reqs], [r.output_token_ids for r in reqs])
        self.grammars.accept(ids, specs, tokens)
        self._record_logprobs(reqs, sampled, tokens)  # from the raw logits, as vLLM's default
        now = time.monotonic()
        for req, tok in zip(reqs, tokens):
            self._emit(req, tok, now)

    def _emit(self, req: Request, tok: int, now: float) -> None:
        self.collector.on_token(req, now)
        req.append_token(tok, now)
        self._changed[self._group_of[req.request_id].request_id] = self._group_of[req.request_id]
        self._check_stop(req, tok)

    def _verify(self, chunk, rows: torch.Tensor) -> None:
        """Speculative decoding: rows [1 + K, V] at the last known token and the K drafts; the kept drafts and the
        target's own token are emitted in order (until one stops the request), and the kept drafts' KV counts."""
        req = chunk.request
        if non_finite_rows(rows):
            self._fail_corrupt(req)
            return
        tokens = self.sampler.verify(rows, req.request_id, req.params, req.all_token_ids, req.output_token_ids,
                                     chunk.drafts)
        req.num_computed_tokens += len(tokens) - 1  # the kept drafts were computed in this step's forward
        self.collector.on_speculation(len(chunk.drafts), len(tokens) - 1)
        now = time.monotonic()
        for j, tok in enumerate(tokens):
            self._record_logprobs([req], rows[j:j + 1], [tok])
            self._emit(req, tok, now)
            if req.is_finished:
                return

    def _propose(self, reqs: list[Request]) -> None:
        """Next step's drafts for each running request (none under a grammar, whose mask the drafts would skip)."""
        spec = self.cfg.speculative_config
        for req in reqs:
            req.draft_token_ids = []
            if req.is_finished or req.params.structured_outputs is not None:
                continue
            room = min(spec.num_speculative_tokens, req.params.max_tokens - req.num_output_tokens - 1,
                       self.max_model_len - req.num_tokens - 1)
            if room > 0:
                if req.ngram_index is None:
                    req.ngram_index = NgramIndex(spec.prompt_lookup_max, spec.prompt_lookup_min)
                req.draft_token_ids = req.ngram_index.propose(req.all_token_ids, room)

    def _fail_non_finite(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[Request], torch.Tensor]:
        """Fail the requests whose logits hold NaN or inf (corrupt weights, an overflow): an error, never text
        (greedy sampling of NaN picks token 0 every time); the others and their rows go on."""
        bad = set(non_finite_rows(logits))
        if not bad:
            return reqs, logits
        for i in bad:
            self._fail_corrupt(reqs[i])
        keep = [i for i in range(len(reqs)) if i not in bad]
        return [reqs[i] for i in keep], logits[keep]

    def _fail_corrupt(self, req: Request) -> None:
        req.error = "non-finite logits (NaN or inf): the model's weights or activations are corrupt"
        self._finish(req, "error")

    def _record_logprobs(self, reqs: list[Request], logits: torch.Tensor, tokens: list[int]) -> None:
        rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not rows:
            return
        dicts = logprob_dicts(logits[rows], [tokens[i] for i in rows], [reqs[i].params.logprobs for i in rows],
                              self._token_texts)
        for i, d in zip(rows, dicts):
            # a byte-fallback piece's text in the context of the sample's tokens so far (vLLM's: outputs only)
            reqs[i].logprobs.append(self._token_texts.correct(d, reqs[i].output_token_ids[-MAX_CONTEXT:]))
            reqs[i].cumulative_logprob += d[tokens[i]].logprob

    def _record_prompt_logprobs(self, out: SchedulerOutput, logits: torch.Tensor) -> None:
        """Row k of a chunk's span scores prompt token start + k + 1 (recomputed positions overwrite)."""
        row = 0
        for chunk, _, count in out.prompt_logprob_spans():
            req = chunk.request
            positions = range(chunk.start, chunk.start + count)
            dicts = logprob_dicts(logits[row:row + count], [req.prompt_token_ids[p + 1] for p in positions],
                                  [req.params.prompt_logprobs] * count, self._token_texts)
            for p, d in zip(positions, dicts):
                # the context of prompt token p + 1: the scored prompt tokens before it (token 0 is never scored)
                context = req.prompt_token_ids[max(1, p + 1 - MAX_CONTEXT):p + 1]
                req.prompt_logprobs[p + 1] = self._token_texts.correct(d, context)
            row += count

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        delta = self._detoks[req.request_id].add(tok)
        req.text += delta
        reason, stop_reason = None, None
        if tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif tok in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        elif p.stop and delta and req.num_output_tokens >= p.min_tokens \
                and (hit := find_stop(req.text, len(delta), p.stop)):
            idx, stop = hit
            req.text = req.text[:idx + len(stop)] if p.include_stop_str_in_output else req.text[:idx]
            reason, stop_reason = "stop", stop
        elif self.grammars.finished(req.request_id):  # the structured output is complete: nothing may follow
            reason = "stop"
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self._finish(req, reason, stop_reason)

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Any way a request ends: its blocks go back, its per-request state is dropped, it is counted."""
        self.scheduler.finish(req, reason, stop_reason)
        req.metrics.finished_time = time.monotonic()
        self.sampler.release(req.request_id)
        self.grammars.release(req.request_id)
        self._detoks.pop(req.request_id, None)
        self.collector.on_finished(req)
        group = self._group_of[req.request_id]
        self._changed[group.request_id] = group

    def get_stats(self) -> EngineStats:
        sched, c, kv = self.scheduler, self.collector, self.kv
        swap_total = self.swap.num_blocks if self.swap is not None else 0
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_preempted=sum(1 for r in sched.waiting if r.status == RequestStatus.PREEMPTED),
            num_swapped=sched.num_swapped,
            num_preemptions_total=sched.num_preemptions,
            num_swap_outs=sched.num_swap_outs,
            swap_blocks_used=swap_total - (self.swap.num_free if self.swap is not None else 0),
            swap_blocks_total=swap_total,
            kv_usage=kv.usage(), kv_blocks_free=kv.num_free_blocks, kv_blocks_total=self.kv_plan.num_blocks,
            kv_tokens_held=sum(r.num_computed_tokens for r in sched.running),
            kv_capacity_tokens=self.kv_plan.capacity_tokens,
            prefix_cache_queries=kv.prefix_stats.queries, prefix_cache_hits=kv.prefix_stats.hits,
            prompt_tokens=c.prompt_tokens, generation_tokens=c.generation_tokens, num_finished=c.num_finished,
            finished_by_reason=dict(c.finished_by_reason),
            time_to_first_token=c.ttft.copy(), inter_token_latency=c.itl.copy(), e2e_latency=c.e2e.copy(),
            iteration_tokens=c.iteration_tokens.copy(), spec=c.spec.copy(),
        )
