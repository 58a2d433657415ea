"""LLM: the offline API, with vLLM's names (`LLM(...).generate(prompts, SamplingParams(...))`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from quantkit.engine.config import EngineConfig
from quantkit.engine.llm_engine import LLMEngine
from quantkit.engine.pooling import DEFAULT_POOLING, PoolingParams
from quantkit.engine.request import RequestOutput
from quantkit.engine.sampling_params import SamplingParams
from quantkit.errors import QuantkitError

Prompt = str | Sequence[int]


class LLM:
    """LLM(model, max_num_seqs=64, max_model_len=None, enable_prefix_caching=True, ...): see EngineConfig."""

    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in the prompts' order.

        A prompt is a string or a list of token ids. `on_output` is called as each request finishes
        (a progress bar hooks in here).
        """
        prompts = _as_list(prompts)
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise QuantkitError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return self._run(prompts, params, on_output)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str = DEFAULT_POOLING,
              normalize: bool = True) -> list[EmbeddingOutput]:
        """The embedding of every prompt (text or token ids), batched through the engine's forward: the final
        hidden state, after the final norm, pooled by `pooling` ("last", vLLM's default for a generative model, or
        "mean"), L2-normalized unless `normalize` is False. A bad prompt raises QuantkitError."""
        prompts = _as_list(prompts)
        params = PoolingParams(pooling, normalize)
        outs = self._run(prompts, [params] * len(prompts))
        if (bad := next((o for o in outs if o.error), None)) is not None:
            raise QuantkitError(f"embed: {bad.error}")
        return [EmbeddingOutput(o.request_id, o.prompt_token_ids, o.embedding.tolist()) for o in outs]

    def _run(self, prompts: list, params: list, on_output=None) -> list[RequestOutput]:
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(finished_only=True):
                results[out.request_id] = out
                if on_output is not None:
                    on_output(out)
        return [results[i] for i in ids]


@dataclass(frozen=True)
class EmbeddingOutput:
    """One prompt's embedding (`LLM.embed`)."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]


def _as_list(prompts):
    """One prompt (a string or a list of token ids) as a list of one; a list of prompts as it is."""
    return [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else list(prompts)


def context_limit_note(out: RequestOutput, params: SamplingParams, max_model_len: int) -> str | None:
    """A note when a request stopped at the context limit rather than at max_tokens; else None.

    The engine gives both finish_reason "length"; this tells them apart from the token counts.
    """
    completion = out.outputs[0]
    generated = len(completion.token_ids)
    if out.error or completion.finish_reason != "length" or generated >= params.max_tokens:
        return None
    if len(out.prompt_token_ids) + generated < max_model_len:
        return None
    return (f"stopped at the context limit (max_model_len {max_model_len}) after {generated} tokens, "
            f"before max_tokens {params.max_tokens}")
