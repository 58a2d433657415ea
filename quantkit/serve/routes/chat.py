"""POST /v1/chat/completions: messages (and tools) through the chat template, then the engine."""

from __future__ import annotations

from fastapi import APIRouter, Request

from quantkit.serve.chat_template import render_chat
from quantkit.serve.errors import APIError
from quantkit.serve.fields import CHAT
from quantkit.serve.generation import Job
from quantkit.serve.protocol import ChatCompletionRequest
from quantkit.serve.responses import Format
from quantkit.serve.routes.common import admit, encode, log_user
from quantkit.serve.sampling import check_context, num_logprobs, requested_max_tokens, sampling_params
from quantkit.serve.structured import structured_spec
from quantkit.serve.tool_choice import chat_tool_request, plan_tools

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state, engine, model = admit(request, body, CHAT)
    settings = state.settings
    tools = plan_tools(chat_tool_request(body), settings.enable_auto_tool_choice, settings.tool_call_parser)
    spec = structured_spec(body)
    if tools.spec is not None:
        if spec is not None:
            raise APIError(400, f"tool_choice {tools.mode} holds the output to its tools' schema: it cannot take a "
                                "structured output too", param="tool_choice")
        spec = tools.spec
    text = render_chat(state.tokenizer, body.messages, state.settings.chat_template, body.add_generation_prompt,
                       body.continue_final_message, body.chat_template_kwargs, tools.tools or None)
    ids = encode(state.tokenizer, text, add_special_tokens=False)  # the template writes its own special tokens
    max_tokens = check_context(len(ids), requested_max_tokens(body), engine.max_model_len)
    params = sampling_params(body, max_tokens, max_n=state.settings.engine.max_num_seqs,
                             vocab_size=len(state.tokenizer), structured=spec)
    state.check_queue()
    fmt = Format(chat=True, model=model, tokenizer=state.tokenizer, top_logprobs=num_logprobs(body),
                 tokens_as_ids=body.return_tokens_as_token_ids, tools=tools,
                 vllm_prompt_logprobs=body.prompt_logprobs is not None)
    log_user(body, fmt.id)
    return await Job.for_body(state, fmt, [ids], params, body).run(request, body.stream)
