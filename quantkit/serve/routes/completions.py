"""POST /v1/completions: string, list of strings or token ids; echo; logprobs; best_of; streaming.

`echo` with `logprobs` also scores the prompt (vLLM's way): the engine computes prompt logprobs, and
the choice's logprobs list the prompt's tokens first (the first one with a null logprob).
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request

from quantkit.serve.fields import COMPLETIONS
from quantkit.serve.generation import Job
from quantkit.serve.protocol import CompletionRequest
from quantkit.serve.responses import Format
from quantkit.serve.routes.common import admit, check_token_ids, log_user, prompt_token_ids
from quantkit.serve.sampling import check_context, num_logprobs, requested_max_tokens, sampling_params
from quantkit.serve.structured import structured_spec

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state, engine, model = admit(request, body, COMPLETIONS)
    spec = structured_spec(body)
    tokenizer = state.tokenizer
    prompts = prompt_token_ids(tokenizer, body.prompt)
    max_tokens = requested_max_tokens(body)
    for ids in prompts:
        check_context(len(ids), max_tokens, engine.max_model_len)
    check_token_ids(tokenizer, prompts)
    params = sampling_params(body, max_tokens, max_n=state.settings.engine.max_num_seqs,
                             vocab_size=len(tokenizer), structured=spec)
    state.check_queue()
    echo = None
    if body.echo:
        echo = [body.prompt] if isinstance(body.prompt, str) else (
            list(body.prompt) if isinstance(body.prompt[0], str) else [tokenizer.decode(p) for p in prompts])
        if num_logprobs(body) is not None:
            params = dataclasses.replace(params, prompt_logprobs=max(params.logprobs, params.prompt_logprobs or 0))
    fmt = Format(chat=False, model=model, tokenizer=tokenizer, top_logprobs=num_logprobs(body),
                 tokens_as_ids=body.return_tokens_as_token_ids, echo_texts=echo,
                 vllm_prompt_logprobs=body.prompt_logprobs is not None)
    log_user(body, fmt.id)
    return await Job.for_body(state, fmt, prompts, params, body).run(request, body.stream)
