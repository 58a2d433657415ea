"""Logprobs' token texts as vLLM 0.32 writes them (vllm/tokenizers/detokenizer_utils.py convert_ids_list_to_tokens,
vllm/v1/engine/logprobs.py _correct_decoded_token): leading spaces back for Metaspace tokenizers only, and
byte-fallback pieces decoded in their context. Checked against vLLM's own server on the same requests
(tests/interop/test_logprobs_vs_vllm.py); here on stories260K's real tokenizer, no vLLM needed."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from quantkit.engine.request import Logprob
from quantkit.engine.token_text import TokenTexts, leading_space_marker
from tests_support.tiny_models import with_metaspace_tokenizer

# stories260K's ids: "café" = ▁c a f é; "日" = ▁ <0xE6> <0x97> <0xA5> (byte fallback)
C, A, SPACE, E6, X97, XA5 = 280, 412, 410, 233, 154, 168


@pytest.fixture(scope="module")
def legacy(stories_dir):
    return AutoTokenizer.from_pretrained(stories_dir)


@pytest.fixture(scope="module")
def metaspace(stories_dir, tmp_path_factory):
    return AutoTokenizer.from_pretrained(with_metaspace_tokenizer(stories_dir, tmp_path_factory.mktemp("ms") / "m"))


def test_leading_spaces_come_back_only_for_metaspace_tokenizers(legacy, metaspace):
    assert leading_space_marker(legacy) is None and leading_space_marker(metaspace) == "\u2581"
    assert legacy.convert_ids_to_tokens([C, SPACE]) == ["\u2581c", "\u2581"] == metaspace.convert_ids_to_tokens([C, SPACE])
    assert [TokenTexts(legacy)(t) for t in (C, A, SPACE)] == ["c", "a", ""]  # as decode() gives them
    assert [TokenTexts(metaspace)(t) for t in (C, A, SPACE)] == [" c", "a", " "]


def test_byte_fallback_pieces_are_read_in_their_context(legacy):
    texts = TokenTexts(legacy)
    assert [texts(t) for t in (E6, X97, XA5)] == ["\ufffd"] * 3
    # each incomplete piece is "", the one that completes the character carries it
    assert [texts.in_context(E6, [SPACE]), texts.in_context(X97, [SPACE, E6]),
            texts.in_context(XA5, [SPACE, E6, X97])] == ["", "", "日"]
    assert texts.in_context(XA5, []) == ""  # no context (a sample's first token): incomplete
    entries = {XA5: Logprob(-0.5, 1, "\ufffd"), C: Logprob(-1.5, 2, "c")}
    fixed = texts.correct(entries, [C, SPACE, E6, X97])
    assert fixed == {XA5: Logprob(-0.5, 1, "日"), C: Logprob(-1.5, 2, "c")} and list(fixed) == [XA5, C]
