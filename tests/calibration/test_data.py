"""Calibration loading: local formats, deterministic sampling, clear errors offline."""

import json

import pytest
import torch

from quantkit.calibration.data import load_calibration, read_local_documents, split_text_documents
from quantkit.calibration.synthetic import build_tokenizer
from quantkit.errors import QuantkitError


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300, num_stories=200)


def test_txt_documents_split_on_blank_lines(tmp_path):
    assert split_text_documents("a b\nc\n\n\nd\n  \ne f\n") == ["a b\nc", "d", "e f"]


def test_jsonl_and_folder(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    (tmp_path / "b.txt").write_text("three\n\nfour")
    assert read_local_documents(tmp_path / "a.jsonl") == ["one", "two"]
    assert read_local_documents(tmp_path) == ["one", "two", "three", "four"]


def test_bad_jsonl_names_the_line(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(QuantkitError, match=r"c.jsonl:2"):
        read_local_documents(f)


def test_sampling_is_deterministic_for_a_seed(tmp_path, tok):
    from quantkit.calibration.synthetic import make_corpus

    f = tmp_path / "c.txt"
    f.write_text("\n\n".join(make_corpus(300, seed=5)))
    a = load_calibration(str(f), tok, nsamples=8, seqlen=32, seed=1)
    b = load_calibration(str(f), tok, nsamples=8, seqlen=32, seed=1)
    c = load_calibration(str(f), tok, nsamples=8, seqlen=32, seed=2)
    assert a.input_ids.shape == (8, 32)
    assert torch.equal(a.input_ids, b.input_ids) and a.token_hash == b.token_hash
    assert not torch.equal(a.input_ids, c.input_ids)


def test_short_text_lowers_seqlen_with_a_note(tmp_path, tok):
    f = tmp_path / "short.txt"
    f.write_text("Once upon a time.")
    calib = load_calibration(str(f), tok, nsamples=2, seqlen=512, seed=0)
    assert calib.input_ids.shape[1] < 512 and "seqlen lowered" in calib.notes[0]


def test_empty_and_missing_and_offline_recipe(tmp_path, tok, monkeypatch):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(QuantkitError, match="empty"):
        load_calibration(str(tmp_path / "empty.txt"), tok, 4, 16, 0)
    with pytest.raises(QuantkitError, match="no such calibration file"):
        load_calibration(str(tmp_path / "nope.txt"), tok, 4, 16, 0)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(QuantkitError, match="offline.*--calib"):
        load_calibration("wikitext2", tok, 4, 16, 0)
    with pytest.raises(QuantkitError, match="unknown calibration source"):
        load_calibration("notarecipe", tok, 4, 16, 0)


def test_hub_recipe_reads_the_named_dataset_when_online(tok, monkeypatch):
    import datasets

    from quantkit.calibration.synthetic import make_corpus

    asked = {}

    def fake_load_dataset(name, config=None, split=None, data_files=None):
        asked.update(name=name, config=config, split=split)
        return [{"text": t} for t in make_corpus(50, seed=9)] + [{"text": "   "}]

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    calib = load_calibration("wikitext2", tok, nsamples=4, seqlen=32, seed=0)
    assert asked == {"name": "wikitext", "config": "wikitext-2-raw-v1", "split": "train"}
    assert calib.input_ids.shape == (4, 32) and calib.source == "wikitext2"
