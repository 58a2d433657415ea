"""Embeddings from the decoder's own forward: the final hidden state (after the final norm) pooled over a prompt.

A pooling request is scheduled like a prompt (chunked prefill, the paged cache, the 4-bit linears, batched beside
decodes) but samples nothing: the forward hands back the final-normed hidden rows it asks for, and the request
finishes once its last prompt token ran. Pooling methods (vLLM's names, lower case):
  last  the last token's state: vLLM's default for a generative model served for embeddings (`--convert embed`,
        pooling type LAST, normalized); in a causal model only the last token has seen the whole input
  mean  the mean over every prompt token's state; a request pooled by mean computes its whole prompt (a prefix hit
        would leave the cached tokens' states out), and starts its sum again when preempted by recompute
The pooled vector is L2-normalized (vLLM's default for embeddings; OpenAI's embeddings are unit length too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.engine.sampling_params import SamplingParams
from quantkit.errors import QuantkitError

POOLING_METHODS = ("last", "mean")
DEFAULT_POOLING = "last"  # vLLM's for a decoder LM served for embeddings
POOLING_SAMPLING = SamplingParams(max_tokens=1)  # an embedding request's (unused) sampling: one output, no logprobs


@dataclass(frozen=True)
class PoolingParams:
    """What one embedding request asks for (vLLM's PoolingParams in spirit): the pooling method, normalization."""

    pooling: str = DEFAULT_POOLING
    normalize: bool = True
    n: int = 1  # one output per prompt (the server's accounting reads `n` of any request's params)

    def __post_init__(self):
        if self.pooling not in POOLING_METHODS:
            raise QuantkitError(f"pooling {self.pooling!r}: expected one of {', '.join(POOLING_METHODS)}")

    @property
    def needs_every_token(self) -> bool:
        """Whether every prompt position's state is pooled (no prefix-cache hits then)."""
        return self.pooling == "mean"


def pooled_rows(params: PoolingParams, start: int, num_tokens: int, prompt_len: int) -> range:
    """The positions of a chunk [start, start + num_tokens) whose hidden states the pooling reads."""
    if params.pooling == "mean":
        return range(start, start + num_tokens)
    last = prompt_len - 1
    return range(last, last + 1) if start <= last < start + num_tokens else range(0)


@dataclass
class PoolingState:
    """A request's running pool over the chunks seen so far: the sum of the states read (fp32) and their count."""

    params: PoolingParams
    total: torch.Tensor | None = None  # [hidden] fp32
    count: int = 0

    def reset(self) -> None:
        self.total, self.count = None, 0

    def add(self, states: torch.Tensor) -> None:
        """states: [rows, hidden], the rows `pooled_rows` named for one chunk."""
        if states.shape[0] == 0:
            return
        chunk = states.float().sum(dim=0)
        self.total = chunk if self.total is None else self.total + chunk
        self.count += states.shape[0]

    def result(self) -> torch.Tensor:
        """The embedding [hidden] fp32: the mean of the states read (one state, for last), normalized if asked."""
        if self.total is None:
            raise QuantkitError("pooling: no hidden state was computed for this request")
        return finish_pool(self.total / self.count, self.params.normalize)


def finish_pool(vector: torch.Tensor, normalize: bool) -> torch.Tensor:
    """L2-normalize a pooled vector [hidden] fp32 (as torch.nn.functional.normalize: eps 1e-12)."""
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def split_params(params: SamplingParams | PoolingParams) -> tuple[SamplingParams, PoolingParams | None]:
    """(what the engine samples with, what it pools with): an embedding request samples nothing (POOLING_SAMPLING)."""
    if isinstance(params, PoolingParams):
        return POOLING_SAMPLING, params
    return params, None


def pool_step(spans: list[tuple], hidden: torch.Tensor | None) -> list:
    """One engine step's embedding requests: add each chunk's pooled rows of `hidden` [rows, hidden] to its request's
    pool (`spans`: SchedulerOutput.pooling_spans(), in the order of those rows). Returns the requests whose prompt has
    now run, each with its `embedding` set, for the engine to finish. A recompute after preemption (a chunk from
    position 0 again) starts the pool again."""
    done, row = [], 0
    for chunk, span in spans:
        req, pool = chunk.request, chunk.request.pooling
        if chunk.start == 0:
            pool.reset()
        if span:  # (a chunk before the one holding the last token reads nothing when pooling by last)
            pool.add(hidden[row:row + len(span)])
            row += len(span)
        if chunk.start + chunk.num_tokens == req.num_tokens:
            req.embedding = pool.result()
            done.append(req)
    return done
