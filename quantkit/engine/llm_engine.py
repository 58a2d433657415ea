"""LLMEngine: add requests, step. One step reads top to bottom: schedule, run the model, sample,
then update each request (detokenize, check stops, free the finished)."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from quantkit.engine.config import EngineConfig
from quantkit.engine.detokenizer import IncrementalDetokenizer, find_stop
from quantkit.engine.kv_cache_manager import KVCacheManager
from quantkit.engine.kv_sizing import plan_kv
from quantkit.engine.model_runner import ModelRunner, kv_block_bytes
from quantkit.engine.request import CompletionOutput, Request, RequestMetrics, RequestOutput, RequestStatus
from quantkit.engine.sampler import Sampler
from quantkit.engine.sampling_params import SamplingParams
from quantkit.engine.scheduler import Scheduler, SchedulerOutput
from quantkit.engine.stats import EngineStats, StatsCollector, StepStats
from quantkit.engine.swap import SwapSpace
from quantkit.engine.weights import load_decoder
from quantkit.errors import QuantkitError

log = logging.getLogger("quantkit.engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise QuantkitError("device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if name == "float16" and device.type == "cpu":
        raise QuantkitError("float16 on CPU is too slow to serve; use float32 or bfloat16")
    return DTYPES[name]


def eos_token_ids(path: Path, config_eos, tokenizer) -> frozenset[int]:
    """EOS ids as HF generate takes them: generation_config.json, else config.json, else the tokenizer."""
    gen = path / "generation_config.json"
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    for value in (gen_eos, config_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            return frozenset([value])
        if isinstance(value, list) and value:
            return frozenset(int(v) for v in value)
    return frozenset()


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        from quantkit.model.checkpoint import resolve_model_path
        from quantkit.model.loader import hf_config, load_tokenizer

        self.cfg = cfg
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)  # asked for explicitly: a process-wide torch setting
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        path = resolve_model_path(cfg.model)
        self.model, self.quant_info = load_decoder(path, self.dtype, self.device)
        self.tokenizer = load_tokenizer(path)
        s = self.model.shape
        self.max_model_len = self._max_model_len(cfg, s)
        self.eos_ids = eos_token_ids(path, getattr(hf_config(path), "eos_token_id", None), self.tokenizer)
        block_bytes = kv_block_bytes(s.num_layers, cfg.block_size, s.num_kv_heads, s.head_dim, self.dtype)
        self.kv_plan = plan_kv(cfg, block_bytes, self.max_model_len, self.device)
        self.kv = KVCacheManager(self.kv_plan.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        swap = SwapSpace(self.kv_plan.num_swap_blocks) if self.kv_plan.num_swap_blocks else None
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, swap)
        self.runner = ModelRunner(self.model, self.kv_plan.num_blocks, cfg.block_size,
                                  self.kv_plan.num_swap_blocks, self.dtype, self.device)
        self.sampler = Sampler(cfg.seed)
        self.collector = StatsCollector()
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._rejected: list[Request] = []
        self._ids = itertools.count()
        self.last_step = StepStats()
        log.info(self.kv_plan.describe())

    @staticmethod
    def _max_model_len(cfg: EngineConfig, s) -> int:
        limit = s.max_position_embeddings
        n = cfg.max_model_len or limit
        if n > limit:
            raise QuantkitError(f"max_model_len {n} exceeds the model's max_position_embeddings {limit}")
        if s.sliding_window is not None and n > s.sliding_window:
            raise QuantkitError(f"max_model_len {n} exceeds the model's sliding window {s.sliding_window}, "
                                f"which the engine does not implement; pass max_model_len <= {s.sliding_window}")
        return n

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids). A bad prompt becomes a finished request with an error."""
        rid = request_id if request_id is not None else str(next(self._ids))
        text = prompt if isinstance(prompt, str) else None
        # verbose=False: _check_prompt says when a prompt is too long (no tokenizer "indexing errors" warning)
        ids = list(prompt) if text is None else (self.tokenizer(text, verbose=False).input_ids if text else [])
        req = Request(rid, ids, params, self.cfg.block_size, prompt=text)
        error = self._check_prompt(ids)
        if error:
            req.status, req.finish_reason, req.error = RequestStatus.FINISHED, "error", error
            self._rejected.append(req)
        else:
            self._detoks[rid] = IncrementalDetokenizer(self.tokenizer, ids)
            self.scheduler.add_request(req)
        return rid

    def _check_prompt(self, ids: list[int]) -> str | None:
        if not ids:
            return "empty prompt"
        if len(ids) > self.max_model_len:
            return f"prompt has {len(ids)} tokens, more than max_model_len {self.max_model_len}"
        vocab = self.model.shape.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            return f"prompt holds token ids outside the vocabulary [0, {vocab})"
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        finished = [self._output(r) for r in self._rejected]
        self._rejected = []
        out = self.scheduler.schedule()
        self.last_step = StepStats(out.num_tokens, len(self.scheduler.running), len(self.scheduler.waiting),
                                   sum(r.num_computed_tokens for r in self.scheduler.running) + out.num_tokens,
                                   self.kv.usage(),
                                   len(out.preempted))
        if not out.chunks:
            return finished
        logits = self.runner.execute(out)
        self.scheduler.update_from_output(out)
        return finished + self._postprocess(out, logits)

    def _postprocess(self, out: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        chunks = [c for c in out.chunks if c.samples]
        reqs = [c.request for c in chunks]
        tokens = self.sampler.sample(logits, [r.request_id for r in reqs], [r.params for r in reqs],
                                     [r.all_token_ids for r in reqs])
        now = time.perf_counter()
        done = []
        for req, tok in zip(reqs, tokens):
            if req.first_token_time is None:
                self.collector.on_tokens(req.num_prompt_tokens, 0)
            req.append_token(tok, now)
            self.collector.on_tokens(0, 1)
            if self._check_stop(req, tok):
                done.append(self._output(req))
        return done

    def _check_stop(self, req: Request, tok: int) -> bool:
        p = req.params
        delta = self._detoks[req.request_id].add(tok)
        req.text += delta
        reason, stop_reason = None, None
        if tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif tok in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        elif p.stop and delta and (hit := find_stop(req.text, len(delta), p.stop)):
            idx, stop = hit
            req.text = req.text[:idx + len(stop)] if p.include_stop_str_in_output else req.text[:idx]
            reason, stop_reason = "stop", stop
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        self.scheduler.finish(req, reason, stop_reason)
        self.sampler.release(req.request_id)
        self._detoks.pop(req.request_id, None)
        self.collector.on_finished(req)
        return True

    def _output(self, req: Request) -> RequestOutput:
        done = req.is_finished
        completion = CompletionOutput(0, req.text, list(req.output_token_ids), req.finish_reason, req.stop_reason)
        metrics = RequestMetrics(req.arrival_time, req.first_token_time, time.perf_counter() if done else None,
                                 req.num_preemptions)
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [completion], done,
                             req.error, metrics)

    def get_stats(self) -> EngineStats:
        sched, c, kv = self.scheduler, self.collector, self.kv
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_preempted=sum(1 for r in sched.waiting if r.status == RequestStatus.PREEMPTED),
            num_preemptions_total=sched.num_preemptions,
            num_swap_outs=sched.num_swap_outs, kv_usage=kv.usage(),
            kv_tokens_held=sum(r.num_computed_tokens for r in sched.running),
            kv_capacity_tokens=self.kv_plan.capacity_tokens,
            prefix_cache_queries=kv.prefix_stats.queries, prefix_cache_hits=kv.prefix_stats.hits,
            prompt_tokens=c.prompt_tokens, generation_tokens=c.generation_tokens, num_finished=c.num_finished,
            time_to_first_token=list(c.ttft), inter_token_latency=list(c.itl),
        )
