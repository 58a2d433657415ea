"""The pure pieces: request models, field mapping, the context check, SSE framing (no server)."""

from __future__ import annotations

import json

import pytest

from quantkit.serve.errors import APIError, sse_error
from quantkit.serve.protocol import ChatCompletionRequest, CompletionRequest
from quantkit.serve.responses import SSE_DONE, sse
from quantkit.serve.sampling import check_context, requested_max_tokens, sampling_params


def test_unknown_fields_are_kept_aside_and_model_is_optional():
    req = CompletionRequest(prompt="hi", best_of=2, suffix="!", n_predict=3)  # the route refuses them by name
    assert req.model is None and set(req.model_extra) == {"suffix", "n_predict"} and req.best_of == 2


def test_fields_map_to_sampling_params():
    req = CompletionRequest(prompt="x", max_tokens=7, temperature=0, stop="END", top_k=5, min_p=0.1, seed=3,
                            presence_penalty=0.5, frequency_penalty=-0.5, n=2, logprobs=4, ignore_eos=True,
                            stop_token_ids=[9], min_tokens=2, repetition_penalty=1.1)
    p = sampling_params(req, requested_max_tokens(req))
    assert (p.max_tokens, p.temperature, p.stop, p.top_k, p.min_p, p.seed, p.n, p.logprobs) == \
        (7, 0, ("END",), 5, 0.1, 3, 2, 4)
    assert (p.presence_penalty, p.frequency_penalty, p.ignore_eos, p.stop_token_ids, p.min_tokens) == \
        (0.5, -0.5, True, (9,), 2)
    assert requested_max_tokens(CompletionRequest(prompt="x")) == 16


def test_chat_max_completion_tokens_wins_and_logprobs_need_the_flag():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=5, max_completion_tokens=9,
                                logprobs=True, top_logprobs=3)
    assert requested_max_tokens(req) == 9 and sampling_params(req, 9).logprobs == 3
    bad = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_logprobs=3)
    with pytest.raises(APIError, match="top_logprobs"):
        sampling_params(bad, 4)


def test_bad_values_are_400_naming_the_field():
    with pytest.raises(APIError) as e:
        sampling_params(CompletionRequest(prompt="x", presence_penalty=3), 4)
    assert e.value.status == 400 and "presence_penalty" in e.value.message


def test_context_check_uses_vllms_wording():
    assert check_context(10, None, 100) == 90
    assert check_context(10, 90, 100) == 90
    with pytest.raises(APIError, match=r"maximum context length is 100 tokens\. However, you requested 101 tokens "
                                       r"\(10 in the messages, 91 in the completion\)"):
        check_context(10, 91, 100)
    with pytest.raises(APIError, match="your request has 100 input tokens"):
        check_context(100, 1, 100)


def test_sse_framing_is_compact_json_events():
    assert sse({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
    ev = sse_error(500, "boom")
    assert ev.startswith("data: ") and ev.endswith("\n\n")
    assert json.loads(ev[6:])["error"] == {"message": "boom", "type": "server_error", "param": None, "code": 500}


def test_chat_text_parts_join_with_a_newline_as_vllms():
    """vLLM joins a message's text parts with "\\n" (checked against vLLM 0.32's /tokenize: the parts tokenize as
    "Hello\\nthere", not "Hellothere")."""
    from quantkit.serve.protocol import ChatMessage

    parts = ChatMessage(role="user", content=[{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}])
    assert parts.text() == "Hello\nthere"
    assert ChatMessage(role="user", content=[{"type": "text", "text": "one"}]).text() == "one"
