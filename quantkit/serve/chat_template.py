"""Chat messages (and tools) -> prompt text through the tokenizer's chat template (or --chat-template)."""

from __future__ import annotations

import json

from quantkit.serve.errors import APIError
from quantkit.serve.protocol import ChatMessage


def template_message(m: ChatMessage) -> dict:
    """A message as chat templates read it: an assistant's tool calls with their arguments decoded (templates write
    them with `tojson`, as vLLM hands them), a tool's answer with its call id."""
    msg = {"role": m.role, "content": m.text() or ""}
    if m.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    for key in ("tool_call_id", "name"):
        if getattr(m, key) is not None:
            msg[key] = getattr(m, key)
    return msg


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise APIError(400, f"a tool call's arguments are not JSON: {text[:80]!r}", param="messages") from None


def render_chat(tokenizer, messages: list[ChatMessage], template: str | None, add_generation_prompt: bool,
                continue_final_message: bool = False, kwargs: dict | None = None,
                tools: list[dict] | None = None) -> str:
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true")
    conversation = [template_message(m) for m in messages]
    return render_conversation(tokenizer, conversation, template, add_generation_prompt, continue_final_message,
                               kwargs, tools)


def render_conversation(tokenizer, conversation: list[dict], template: str | None, add_generation_prompt: bool,
                        continue_final_message: bool = False, kwargs: dict | None = None,
                        tools: list[dict] | None = None) -> str:
    """Chat messages as dicts (with tool_calls and tool results too), and the tools the template shows the model."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; start the server with "
                            "--chat-template FILE (a Jinja template) to use /v1/chat/completions or /v1/responses")
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, tools=tools,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **(kwargs or {}))
    except (ValueError, TypeError, KeyError) as exc:
        raise APIError(400, f"the chat template failed on these messages: {exc}") from exc
    except Exception as exc:  # jinja2's TemplateError and friends: the template, not the server, failed
        if type(exc).__module__.startswith("jinja2"):
            raise APIError(400, f"the chat template failed on these messages: {exc}") from exc
        raise
