"""SamplingParams: what one request asks of the sampler, validated once (vLLM's names)."""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass, field

from quantkit.errors import QuantkitError


MAX_LOGPROBS = 20  # vLLM's default --max-logprobs (EngineConfig.max_logprobs)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's names; exactly one is given): a JSON schema (a dict or its text),
    any JSON object, a regular expression, one of a list of strings, or a grammar (Lark, or llama.cpp's GBNF).
    Enforced by quantkit.engine.structured_outputs."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        if isinstance(self.json, dict):  # as text (hashable: equal specs share one compiled grammar); key order kept,
            object.__setattr__(self, "json", json_module.dumps(self.json))  # properties are generated in it
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise QuantkitError("structured outputs: choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise QuantkitError("structured outputs take exactly one of json, regex, choice, grammar, json_object "
                                f"(got {', '.join(given) or 'none'})")
        if self.json is not None:
            try:
                schema = json_module.loads(self.json)
            except ValueError as exc:
                raise QuantkitError(f"structured outputs: the JSON schema is not JSON ({exc})") from None
            if not isinstance(schema, (dict, bool)):
                raise QuantkitError("structured outputs: a JSON schema is an object (or true/false)")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1: off (HF rule: positive logits divided, negative multiplied)
    seed: int | None = None  # per-request generator: the same seed gives the same tokens in any batch
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1  # parallel samples of one prompt (they share its KV blocks through the prefix cache)
    logprobs: int | None = None  # top alternatives returned beside each sampled token (0..20)
    prompt_logprobs: int | None = None  # the same for each prompt token (0..20)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from the logit of every token in the output so far
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output so far
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens are out
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # output held to a schema, regex, choice or grammar
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits before anything else

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise QuantkitError("logit_bias values must be in [-100, 100] (OpenAI's range)")
        if self.temperature < 0:
            raise QuantkitError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise QuantkitError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < -1:
            raise QuantkitError(f"top_k must be -1, 0 (off) or positive (got {self.top_k})")
        if not 0 <= self.min_p <= 1:
            raise QuantkitError(f"min_p must be in [0, 1] (got {self.min_p})")
        if self.repetition_penalty <= 0:
            raise QuantkitError(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        if self.max_tokens < 1:
            raise QuantkitError(f"max_tokens must be at least 1 (got {self.max_tokens})")
        if self.n < 1:
            raise QuantkitError(f"n must be at least 1 (got {self.n})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:  # the upper bound is the engine's (EngineConfig.max_logprobs)
                raise QuantkitError(f"{name} must be at least 0 (got {value})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise QuantkitError(f"{name} must be in [-2, 2] (got {getattr(self, name)})")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise QuantkitError(f"min_tokens must be in [0, max_tokens={self.max_tokens}] (got {self.min_tokens})")
        if any(not s for s in self.stop):
            raise QuantkitError("stop strings must not be empty")

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
