"""One user request fanned out into its n samples, and their outputs gathered back into one.

Each sample is a child `Request` the scheduler sees like any other; the children share the
prompt's KV blocks through the prefix cache (the first child's full prompt blocks are registered
when it is allocated, so the others hit them, even within the same step). With a seed, child i
samples with seed + i (vLLM's rule), so n samples with a seed are reproducible and child 0
matches the same request with n=1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quantkit.engine.request import CompletionOutput, Request, RequestMetrics, RequestOutput
from quantkit.engine.sampling_params import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child i's params: one sample, seed + i, and prompt logprobs only on child 0 (the others use the cache)."""
    if params.n == 1:
        return params
    return dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + index,
                               prompt_logprobs=params.prompt_logprobs if index == 0 else None)


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def gather_metrics(children: list[Request]) -> RequestMetrics:
    """One request's metrics over its samples: the earliest start times, the latest end times, the sums."""
    for c in children:
        c.metrics.num_preemptions = c.num_preemptions
    ms = [c.metrics for c in children]
    if len(ms) == 1:
        return dataclasses.replace(ms[0])

    def first(name):
        values = [getattr(m, name) for m in ms if getattr(m, name) is not None]
        return min(values) if values else None

    def last(name):
        values = [getattr(m, name) for m in ms]
        return None if any(v is None for v in values) else max(values)

    return RequestMetrics(ms[0].arrival_time, first("first_scheduled_time"), first("first_token_time"),
                          max((m.last_token_time for m in ms if m.last_token_time is not None), default=None),
                          last("finished_time"), sum(m.num_preemptions for m in ms), ms[0].num_prompt_tokens,
                          sum(m.num_generation_tokens for m in ms))


@dataclass(eq=False)
class RequestGroup:
    """A user request: its id, prompt and children (one per sample, `index` 0..n-1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)

    def output(self) -> RequestOutput:
        """Cumulative: every sample's text and tokens so far (and its own metrics once it finished)."""
        metrics = gather_metrics(self.children)
        outs = [CompletionOutput(i, c.visible_text, list(c.output_token_ids), c.finish_reason, c.stop_reason,
                                 None if c.logprobs is None else list(c.logprobs), c.cumulative_logprob,
                                 _finished_metrics(c, metrics, len(self.children)))
                for i, c in enumerate(self.children)]
        first = self.children[0]
        error = next((c.error for c in self.children if c.error), None)
        prompt_lp = None if first.prompt_logprobs is None else list(first.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             error, metrics, prompt_lp, first.embedding)


def _finished_metrics(child: Request, gathered: RequestMetrics, n: int) -> RequestMetrics | None:
    """A finished sample's metrics, a copy (the engine thread owns the child's); one sample's are the request's."""
    if not child.is_finished:
        return None
    return gathered if n == 1 else dataclasses.replace(child.metrics)
