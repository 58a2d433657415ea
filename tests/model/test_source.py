"""open_model: a checkpoint resolved and read once, what is derived from it computed once."""

import json

import pytest
import torch
from safetensors.torch import save_file

from quantkit.errors import QuantkitError
from quantkit.model import checkpoint
from quantkit.model.source import ModelSource, open_model


def _tiny_llama(folder, **extra):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=128, **extra)
    cfg.architectures = ["LlamaForCausalLM"]
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    save_file({"model.embed_tokens.weight": torch.zeros(64, 32)}, str(folder / "model.safetensors"))
    return folder


def test_config_read_once_and_derived_lazily(tmp_path, monkeypatch):
    folder = _tiny_llama(tmp_path / "m")
    reads = []
    real = checkpoint.read_config
    monkeypatch.setattr("quantkit.model.source.read_config", lambda p: reads.append(p) or real(p))
    source = open_model(str(folder))
    assert reads == [folder] and source.name == str(folder) and source.path == folder
    assert source.spec.architectures[0] == "LlamaForCausalLM"
    assert source.quant is None
    hf = source.hf_config
    assert type(hf).__name__ == "LlamaConfig" and hf.num_key_value_heads == 2
    assert source.hf_config is hf and source.reader is source.reader  # computed once
    assert source.reader.keys() == ["model.embed_tokens.weight"]
    assert source.max_context() == 128
    assert len(reads) == 1
    assert open_model(source) is source


def test_hf_config_matches_transformers_own_read(tmp_path):
    from transformers import AutoConfig

    folder = _tiny_llama(tmp_path / "m", rope_theta=5e5, tie_word_embeddings=True)
    ours, theirs = open_model(folder).hf_config.to_dict(), AutoConfig.from_pretrained(str(folder)).to_dict()
    for key in ("_name_or_path", "transformers_version"):
        ours.pop(key, None), theirs.pop(key, None)
    assert ours == theirs


def test_quantization_config_kept_in_config_dropped_from_hf_config(tmp_path):
    folder = _tiny_llama(tmp_path / "q")
    data = json.loads((folder / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                   "sym": True, "checkpoint_format": "gptq"}
    (folder / "config.json").write_text(json.dumps(data))
    source = open_model(folder)
    assert source.quant is not None and source.quant.bits == 4 and source.quant.group_size == 32
    assert "quantization_config" in source.config
    assert not hasattr(source.hf_config, "quantization_config")


def test_unsupported_architecture_fails_on_spec_only(tmp_path):
    folder = _tiny_llama(tmp_path / "x")
    data = json.loads((folder / "config.json").read_text())
    data["architectures"] = ["NoSuchForCausalLM"]
    (folder / "config.json").write_text(json.dumps(data))
    source = open_model(folder)  # opening reads only config.json
    assert isinstance(source, ModelSource)
    with pytest.raises(QuantkitError, match="unsupported architecture 'NoSuchForCausalLM'"):
        source.spec


def test_missing_folder_is_one_line(tmp_path):
    with pytest.raises(QuantkitError, match="no such folder"):
        open_model(str(tmp_path / "absent"))
