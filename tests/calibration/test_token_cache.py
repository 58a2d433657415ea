"""The calibration token cache: same ids as tokenizing, keyed by text and tokenizer."""

import pytest
import torch

from quantkit.calibration.data import load_calibration
from quantkit.calibration.synthetic import build_tokenizer, make_corpus
from quantkit.calibration.token_cache import cached_token_ids


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300, num_stories=200)


def _tokenize(tok):
    calls = []

    def run(text):
        calls.append(text)
        return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
    return run, calls


def test_second_call_reads_the_cache_and_gives_the_same_ids(tmp_path, tok):
    text = "\n\n".join(make_corpus(50, seed=1))
    run, calls = _tokenize(tok)
    first, hit1 = cached_token_ids(text, tok, run, tmp_path)
    second, hit2 = cached_token_ids(text, tok, run, tmp_path)
    assert (hit1, hit2) == (False, True) and len(calls) == 1
    assert torch.equal(first, second) and second.dtype == torch.int64
    assert not list(tmp_path.glob("*.partial"))


def test_other_text_or_tokenizer_misses(tmp_path, tok):
    other_tok = build_tokenizer(vocab_size=280, num_stories=200)
    run, calls = _tokenize(tok)
    cached_token_ids("one text", tok, run, tmp_path)
    assert not cached_token_ids("another text", tok, run, tmp_path)[1]
    assert not cached_token_ids("one text", other_tok, _tokenize(other_tok)[0], tmp_path)[1]
    assert len(list(tmp_path.glob("*.pt"))) == 3


def test_tokenizers_without_a_serialized_form_are_not_cached(tmp_path):
    class Slow:
        pass

    ids, hit = cached_token_ids("text", Slow(), lambda _t: torch.tensor([1, 2]), tmp_path)
    assert not hit and ids.tolist() == [1, 2] and not list(tmp_path.iterdir())


def test_windows_are_the_same_with_and_without_the_cache(tmp_path, tok, monkeypatch):
    f = tmp_path / "c.txt"
    f.write_text("\n\n".join(make_corpus(300, seed=5)))
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    cold = load_calibration(str(f), tok, nsamples=8, seqlen=32, seed=1)
    warm = load_calibration(str(f), tok, nsamples=8, seqlen=32, seed=1)
    assert list((tmp_path / "cache" / "calib-tokens").glob("*.pt"))
    assert torch.equal(cold.input_ids, warm.input_ids)
