"""POST /v1/chat/completions: messages through the chat template, then the engine."""

from __future__ import annotations

from fastapi import APIRouter, Request

from quantkit.serve.chat_template import render_chat
from quantkit.serve.generation import Job
from quantkit.serve.protocol import ChatCompletionRequest
from quantkit.serve.responses import Format
from quantkit.serve.routes.common import encode, server
from quantkit.serve.sampling import check_context, num_logprobs, requested_max_tokens, sampling_params

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = server(request)
    engine = state.require_ready()
    model = state.check_model(body.model)
    text = render_chat(state.tokenizer, body.messages, state.settings.chat_template, body.add_generation_prompt,
                       body.continue_final_message, body.chat_template_kwargs)
    ids = encode(state.tokenizer, text, add_special_tokens=False)  # the template writes its own special tokens
    max_tokens = check_context(len(ids), requested_max_tokens(body), engine.max_model_len)
    params = sampling_params(body, max_tokens, max_n=state.settings.engine.max_num_seqs)
    state.check_queue()
    fmt = Format(chat=True, model=model, tokenizer=state.tokenizer, top_logprobs=num_logprobs(body),
                 tokens_as_ids=body.return_tokens_as_token_ids)
    return await Job.for_body(state, fmt, [ids], params, body).run(request, body.stream)
