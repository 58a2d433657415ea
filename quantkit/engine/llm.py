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
