"""Perplexity equals a plain per-window loop; the protocol and the bad inputs."""

import math

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.eval.perplexity import perplexity, read_ppl_text, tokenize_once
from quantkit.model.loader import load_model, load_tokenizer


def reference_ppl(model, ids: torch.Tensor, seqlen: int) -> float:
    """The GPTQ-paper loop: one window at a time, mean CE over seqlen - 1 predictions, averaged."""
    losses = []
    for i in range(len(ids) // seqlen):
        window = ids[i * seqlen:(i + 1) * seqlen][None]
        with torch.no_grad():
            logits = model(window).logits[0, :-1].float()
        losses.append(torch.nn.functional.cross_entropy(logits, window[0, 1:]).item())
    return math.exp(sum(losses) / len(losses))


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model, _ = load_model(tiny_llama)
    return model, load_tokenizer(tiny_llama)


TEXT = " ".join(f"the story number {i} tells of a cat and a dog who met by the river." for i in range(60))


@pytest.mark.parametrize("seqlen, batch", [(64, 3), (100, 1), (128, 8)])
def test_perplexity_equals_reference_loop(tiny, seqlen, batch):
    model, tok = tiny
    ids, note = tokenize_once(tok, TEXT)
    result = perplexity(model, ids, seqlen, "text", note, batch_size=batch)
    assert result.ppl == pytest.approx(reference_ppl(model, ids, seqlen), rel=1e-5)
    p = result.protocol
    assert p.windows == len(ids) // seqlen and p.tokens == len(ids) and p.predictions == p.windows * (seqlen - 1)
    assert f"{p.windows} non-overlapping windows of {seqlen}" in p.describe()


@pytest.mark.parametrize("limit", [1, 3])
def test_limit_scores_the_first_windows_only(tiny, limit):
    """--limit N (lm-eval's): the perplexity of the first N windows, and the protocol says how many there were."""
    model, tok = tiny
    ids, note = tokenize_once(tok, TEXT)
    seqlen = 64
    total = len(ids) // seqlen
    assert total > 3
    result = perplexity(model, ids, seqlen, "text", note, batch_size=2, limit=limit)
    assert result.ppl == pytest.approx(reference_ppl(model, ids[:limit * seqlen], seqlen), rel=1e-5)
    assert result.ppl != pytest.approx(perplexity(model, ids, seqlen, "text", note).ppl, rel=1e-6)
    p = result.protocol
    assert (p.windows, p.available, p.predictions) == (limit, total, limit * (seqlen - 1))
    assert f"the first {limit} of {total} non-overlapping windows of {seqlen} (--limit)" in p.describe()
    assert f"tail of {len(ids) - total * seqlen} dropped" in p.describe()
    whole = perplexity(model, ids, seqlen, "text", note, limit=total + 5)  # a limit past the text: every window
    assert whole.protocol.windows == total and whole.protocol.available is None


def test_stories_real_text_reference(stories_dir, wikitext_test):
    model, _ = load_model(stories_dir)
    tok = load_tokenizer(stories_dir)
    ids, note = tokenize_once(tok, wikitext_test.read_text()[:20000])
    assert ids[0] == tok.bos_token_id and "one BOS" in note  # Llama tokenizer: one BOS, at the start only
    result = perplexity(model, ids, 256, "wikitext", note, batch_size=4)
    assert result.ppl == pytest.approx(reference_ppl(model, ids, 256), rel=1e-5)
    assert 1 < result.ppl < 10_000


def test_text_shorter_than_one_window(tiny):
    model, tok = tiny
    ids, note = tokenize_once(tok, "a cat")
    with pytest.raises(QuantkitError, match="fewer than one window of --seqlen 64"):
        perplexity(model, ids, 64, "short.txt", note)


def test_missing_text_and_offline_wikitext(tmp_path, monkeypatch):
    with pytest.raises(QuantkitError, match="no such text file"):
        read_ppl_text(str(tmp_path / "nope.txt"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(QuantkitError, match="hub, which is offline"):
        read_ppl_text("wikitext2")
