"""The base-result cache: content hash, settings key, and a base evaluated once."""

import shutil

import pytest

from quantkit.eval.cache import ResultCache
from quantkit.eval.runner import TaskInputs, evaluate_model
from quantkit.eval.settings import EvalSettings

TEXT = " ".join(f"line {i}: the cat sat on the mat and looked at the dog." for i in range(40))


def test_checkpoint_hash_follows_content(tmp_path):
    ckpt = tmp_path / "m"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"a" * 100)
    cache = ResultCache(tmp_path / "cache")
    first = cache.checkpoint_hash(ckpt)
    assert cache.checkpoint_hash(ckpt) == first
    assert (tmp_path / "cache" / "hashes.json").is_file()  # memoised by (path, size, mtime)
    (ckpt / "model.safetensors").write_bytes(b"b" * 100)
    assert cache.checkpoint_hash(ckpt) != first
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    assert cache.checkpoint_hash(copy) == cache.checkpoint_hash(ckpt)  # content, not path


def test_get_put_and_settings_mismatch(tmp_path):
    cache = ResultCache(tmp_path)
    cache.put("abc", {"seqlen": 8}, {"ppl": 3.0})
    assert cache.get("abc", {"seqlen": 8}) == {"ppl": 3.0}
    assert cache.get("abc", {"seqlen": 16}) is None
    assert cache.get("other", {"seqlen": 8}) is None


def test_base_is_evaluated_once(tiny_llama, tmp_path, monkeypatch):
    settings = EvalSettings(tasks=("ppl",), ppl_text="inline", seqlen=32, cache_dir=tmp_path / "cache")
    inputs = TaskInputs(ppl_text=TEXT)
    first = evaluate_model("base", str(tiny_llama), settings, inputs)
    assert first.cached == [] and first.ppl.ppl > 1 and first.memory_bytes > 0

    def no_load(*args, **kwargs):
        raise AssertionError("the base should come from the cache")

    monkeypatch.setattr("quantkit.eval.runner.load_lm", no_load)
    second = evaluate_model("base", str(tiny_llama), settings, inputs)
    assert second.cached == ["ppl"] and second.ppl == first.ppl
    # another seqlen is another key; a quantized model is never served from the cache
    with pytest.raises(AssertionError, match="from the cache"):
        evaluate_model("base", str(tiny_llama), EvalSettings(tasks=("ppl",), ppl_text="inline", seqlen=16,
                                                             cache_dir=tmp_path / "cache"), inputs)
    with pytest.raises(AssertionError, match="from the cache"):
        evaluate_model("quantized", str(tiny_llama), settings, inputs)
