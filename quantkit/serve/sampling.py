"""Request fields -> SamplingParams, and the context-length check (vLLM's wording)."""

from __future__ import annotations

from quantkit.engine.sampling_params import SamplingParams, StructuredOutputsParams
from quantkit.errors import QuantkitError
from quantkit.serve.errors import APIError
from quantkit.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The max_tokens to run with; 400 when prompt + completion cannot fit in the context."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your request "
                            f"has {prompt_len} input tokens. Please reduce the length of the input messages.",
                       param="messages")
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
                            f"completion). Please reduce the length of the messages or completion.",
                       param="max_tokens")
    return max_tokens


def requested_max_tokens(req: SamplingFields) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS


def num_logprobs(req: SamplingFields) -> int | None:
    if isinstance(req, CompletionRequest):
        n = req.logprobs
    elif req.logprobs:
        n = req.top_logprobs or 0
    elif req.top_logprobs is not None:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    else:
        n = None
    if n is not None and n < 0:  # the upper bound is the engine's --max-logprobs, checked at admission
        raise APIError(400, f"logprobs must be at least 0 (got {n})", param="logprobs")
    return n


def logit_bias(req: SamplingFields, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON keys) -> {id: bias}; a 400 for a key that is not a token id here."""
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias: token id {token} is out of vocabulary [0, {vocab_size})",
                           param="logit_bias")
        bias[token] = value
    return bias


def samples_to_run(req: SamplingFields) -> int:
    """How many samples the engine runs: n, or best_of (completions), which must be at least n and not streamed."""
    best_of = getattr(req, "best_of", None)
    if best_of is None:
        return req.n
    if best_of < req.n:
        raise APIError(400, f"best_of must be at least n ({req.n}), got {best_of}", param="best_of")
    if best_of > req.n and req.stream:
        raise APIError(400, "best_of above n cannot be streamed (the best are known only at the end)",
                       param="best_of")
    return best_of


def sampling_params(req: SamplingFields, max_tokens: int, max_n: int | None = None, vocab_size: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """Validated SamplingParams; a bad value is a 400 naming the field. `max_n`: the most parallel samples
    one request may ask for (the engine's batch, --max-num-seqs): `n` (or best_of) is otherwise unbounded work."""
    n = samples_to_run(req)
    if max_n is not None and n > max_n:
        name = "n" if n == req.n else "best_of"
        raise APIError(400, f"{name} must be at most {max_n} (--max-num-seqs), got {n}", param=name)
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs is not available with stream=true", param="prompt_logprobs")
    logprobs = num_logprobs(req)
    if n > req.n and logprobs is None:
        logprobs = 0  # best_of ranks samples by cumulative logprob, which the engine sums only when asked
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    kwargs = dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0, min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, n=n,
        stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens, spaces_between_special_tokens=req.spaces_between_special_tokens,
        prompt_logprobs=req.prompt_logprobs, structured_outputs=structured,
        logit_bias=logit_bias(req, vocab_size) if vocab_size is not None else {},
    )
    try:
        return SamplingParams(**kwargs)
    except QuantkitError as exc:
        raise APIError(400, str(exc)) from exc
