"""LLM: the offline API, with vLLM's names (`LLM(...).generate(prompts, SamplingParams(...))`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from quantkit.engine.config import EngineConfig
from quantkit.engine.llm_engine import LLMEngine
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
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise QuantkitError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(finished_only=True):
                results[out.request_id] = out
                if on_output is not None:
                    on_output(out)
        return [results[i] for i in ids]


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
