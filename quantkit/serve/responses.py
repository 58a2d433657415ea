"""Response bodies and stream chunks, as OpenAI and vLLM write them (plain dicts -> compact JSON)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from quantkit.engine.request import CompletionOutput, RequestOutput
from quantkit.serve.tool_choice import ToolDelta, ToolPlan, calls_stream, message_calls


_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # built once (dumps with options builds one per call)


def sse(obj: dict) -> str:
    return f"data: {_COMPACT.encode(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_text(tokenizer, token_id: int, decoded: str | None) -> str:
    """A token's text in logprobs; tokenizer None means "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return decoded if decoded is not None else tokenizer.decode([token_id])


def completion_logprobs(tokenizer, out: CompletionOutput, start: int, end: int, offset: int) -> dict:
    """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs, text_offset (for tokens start..end)."""
    return legacy_logprobs(tokenizer, out.token_ids[start:end], out.logprobs[start:end], offset)


def legacy_logprobs(tokenizer, token_ids: Sequence[int], entries: Sequence[dict | None], offset: int) -> dict:
    """The legacy shape for tokens and their logprob entries; an entry None (the first prompt token, which
    nothing before it scores) gives a null logprob and null top_logprobs, as vLLM writes it."""
    tokens, lps, tops, offsets = [], [], [], []
    for tok, entry in zip(token_ids, entries):
        text = token_text(tokenizer, tok, entry[tok].decoded_token if entry else None)
        tokens.append(text)
        lps.append(entry[tok].logprob if entry else None)
        tops.append({token_text(tokenizer, t, lp.decoded_token): lp.logprob for t, lp in entry.items()}
                    if entry else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def next_text_offset(lp: dict | None, offset: int) -> int:
    """Where the token after a legacy logprobs object starts: its last token's offset plus that token's length
    (vLLM advances text_offset by the tokens reported, not by the text, which a stop string can hold back);
    `offset` when it reports no token (or is chat's shape, which has no offsets)."""
    if not lp or not lp.get("tokens"):
        return offset
    return lp["text_offset"][-1] + len(lp["tokens"][-1])


def join_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two legacy logprobs objects, one after the other (an echoed prompt's, then the completion's)."""
    if first is None or second is None:
        return first or second
    return {k: first[k] + second[k] for k in first}


def chat_logprobs(tokenizer, out: CompletionOutput, start: int, end: int, top: int) -> dict:
    """OpenAI's chat shape: content = [{token, logprob, bytes, top_logprobs: [...]}]."""
    def item(t, lp):
        text = token_text(tokenizer, t, lp.decoded_token)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for tok, entry in zip(out.token_ids[start:end], out.logprobs[start:end]):
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        content.append({**item(tok, entry[tok]), "top_logprobs": [item(t, lp) for t, lp in ranked[:top]]})
    return {"content": content}


@dataclass
class Format:
    """What differs between /v1/completions and /v1/chat/completions on the wire."""

    chat: bool
    model: str
    tokenizer: object
    top_logprobs: int | None  # None: logprobs not asked for
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text
    tokens_as_ids: bool = False
    tools: ToolPlan | None = None  # chat with tools: outputs become tool calls
    vllm_prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for: reported in vLLM's shape

    def __post_init__(self):
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._calls: dict[int, object] = {}  # choice index -> its tool-call stream parser

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def logprobs(self, out: CompletionOutput, start: int, end: int, offset: int) -> dict | None:
        if self.top_logprobs is None or out.logprobs is None:
            return None
        tokenizer = None if self.tokens_as_ids else self.tokenizer
        if self.chat:
            return chat_logprobs(tokenizer, out, start, end, self.top_logprobs)
        return completion_logprobs(tokenizer, out, start, end, offset)

    def prompt_logprobs(self, req: RequestOutput | None) -> dict | None:
        """The echoed prompt's logprobs (completions with echo and logprobs), else None."""
        if self.chat or not self.echo_texts or self.top_logprobs is None or req is None or req.prompt_logprobs is None:
            return None
        tokenizer = None if self.tokens_as_ids else self.tokenizer
        return legacy_logprobs(tokenizer, req.prompt_token_ids, req.prompt_logprobs, 0)

    def first_chunks(self, indices: list[int]) -> list[dict]:
        """Chat streams open each choice with the role."""
        if not self.chat:
            return []
        return [self.envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}], chunk=True) for i in indices]

    def delta_choice(self, index: int, text: str, out: CompletionOutput, start: int, end: int, offset: int,
                     finished: bool, prompt_lp: dict | None = None) -> dict:
        """`prompt_lp`: the echoed prompt's logprobs, sent before the first tokens' (its first chunk); `offset`:
        the text_offset of the first token reported (the prompt's, with it)."""
        reason = out.finish_reason if finished else None
        lp = join_logprobs(prompt_lp, self.logprobs(out, start, end, next_text_offset(prompt_lp, offset)))
        if self.chat:
            return {"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": reason,
                    "stop_reason": out.stop_reason if finished else None}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason,
                "stop_reason": out.stop_reason if finished else None}

    def delta_choices(self, index: int, text: str, out: CompletionOutput, start: int, end: int, offset: int,
                      finished: bool, prompt_lp: dict | None = None) -> list[dict]:
        """The choices of one step's chunks: one (delta_choice), or under tools, the content and then each call's
        start and argument fragments apart (none while a parser holds text back)."""
        if not self.chat or self.tools is None:
            return [self.delta_choice(index, text, out, start, end, offset, finished, prompt_lp)]
        if index not in self._calls:
            self._calls[index] = calls_stream(self.tools)
        stream = self._calls[index]
        if stream is None:
            return [self.delta_choice(index, text, out, start, end, offset, finished, prompt_lp)]
        deltas = stream.feed(text) + (stream.finish() if finished else [])
        pieces = tool_call_pieces(deltas)
        if not pieces and not finished:
            return []
        pieces = pieces or [{}]
        choices = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in pieces]
        choices[0]["logprobs"] = self.logprobs(out, start, end, offset)
        if finished:
            choices[-1]["finish_reason"] = call_finish_reason(out.finish_reason, stream.num_calls)
            choices[-1]["stop_reason"] = out.stop_reason
        return choices

    def full_choice(self, index: int, prompt_index: int, out: CompletionOutput, req: RequestOutput | None = None) -> dict:
        echo = self.echo_texts[prompt_index] if self.echo_texts else ""
        prompt_lp = self.prompt_logprobs(req)  # text_offset runs on through the prompt's tokens, as vLLM's
        lp = join_logprobs(prompt_lp, self.logprobs(out, 0, len(out.token_ids), next_text_offset(prompt_lp, 0)))
        if self.chat:
            message, reason = {"role": "assistant", "content": out.text}, out.finish_reason
            if self.tools is not None:
                content, calls = message_calls(self.tools, out.text, out.finish_reason)
                message["content"] = content
                if calls:
                    message["tool_calls"] = [{"id": c.id, "type": "function",
                                              "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                reason = call_finish_reason(reason, len(calls))
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason,
                    "stop_reason": out.stop_reason}
        choice = {"index": index, "text": echo + out.text, "logprobs": lp, "finish_reason": out.finish_reason,
                  "stop_reason": out.stop_reason}
        if self.vllm_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(req)
        return choice


def call_finish_reason(reason: str | None, num_calls: int) -> str | None:
    """OpenAI's "tool_calls" where the model stopped after calling."""
    return "tool_calls" if num_calls and reason == "stop" else reason


def tool_call_pieces(deltas: list[ToolDelta]) -> list[dict]:
    """Stream deltas -> chunk deltas: the content first, then each call's start on its own, then its argument
    fragments joined (OpenAI sends a call's id and name, then its arguments in pieces)."""
    content = "".join(d.content for d in deltas if d.content is not None)
    pieces: list[dict] = [{"content": content}] if content else []
    fragment_of = None  # the call whose fragment the last piece holds
    for d in deltas:
        if d.content is not None:
            continue
        if d.id is None and fragment_of == d.index:
            pieces[-1]["tool_calls"][0]["function"]["arguments"] += d.arguments
            continue
        pieces.append({"tool_calls": [d.wire()]})
        fragment_of = None if d.id is not None else d.index
    return pieces


def vllm_prompt_logprobs(req: RequestOutput | None) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}} (the first null)."""
    if req is None or req.prompt_logprobs is None:
        return None
    return [None if entry is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token} for t, lp in entry.items()}
            for entry in req.prompt_logprobs]
