"""The paged-KV engine: continuous batching, prefix caching, preemption; offline API `LLM`.

Imports are lazy so that `import quantkit.engine` stays cheap (no torch/transformers at import).
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics",
           "AsyncLLM", "PoolingParams", "EmbeddingOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from quantkit.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from quantkit.engine import sampling_params

        return getattr(sampling_params, name)
    if name == "PoolingParams":
        from quantkit.engine.pooling import PoolingParams

        return PoolingParams
    if name == "EmbeddingOutput":
        from quantkit.engine.llm import EmbeddingOutput

        return EmbeddingOutput
    if name == "EngineConfig":
        from quantkit.engine.config import EngineConfig

        return EngineConfig
    if name == "AsyncLLM":
        from quantkit.engine.async_llm import AsyncLLM

        return AsyncLLM
    if name in ("RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics"):
        from quantkit.engine import request

        return getattr(request, name)
    raise AttributeError(name)
