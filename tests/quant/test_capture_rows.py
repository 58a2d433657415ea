"""Layer 0's calibration inputs come from the embedding rows of the calibration's tokens alone
(quantkit.quant.pipeline._first_layer_inputs): the same hidden states and layer arguments, bit for bit, as a capture
through the whole fp32 table, and the table itself is never read whole."""

from __future__ import annotations

import pytest
import torch

from quantkit.format.arch import get_submodule
from quantkit.model.checkpoint import ShardReader
from quantkit.model.loader import build_skeleton
from quantkit.model.source import open_model
from quantkit.quant import pipeline
from quantkit.quant.capture import batch_samples, capture_layer_inputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def whole_table_capture(source, input_ids):
    """The capture through the whole embedding table in fp32, the model fed the token ids (the reference)."""
    model = build_skeleton(source.hf_config, torch.float32)
    spec, reader = source.spec, source.reader
    embed = {k: reader.get(k).float() for k in reader.keys() if k.startswith(spec.embed + ".")}
    model.load_state_dict(embed, strict=False, assign=True)
    inputs, kwargs = capture_layer_inputs(get_submodule(model, spec.layers.rpartition(".")[0]),
                                          get_submodule(model, spec.layers), input_ids, torch.device("cpu"))
    return batch_samples(inputs), kwargs


def assert_same(a, b):
    """Nested tuples / lists / dicts of tensors equal bit for bit."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe"])  # gemma3: embeddings scaled in the module
def test_layer0_inputs_from_the_tokens_rows_are_the_whole_tables(tiny_family, monkeypatch, family):
    source = open_model(str(tiny_family(family)))
    input_ids = torch.randint(3, 500, (3, 40), generator=torch.Generator().manual_seed(0))
    input_ids[0, :5] = 499  # repeats, and the highest id
    expected = whole_table_capture(source, input_ids)

    read_whole = []
    monkeypatch.setattr(ShardReader, "get", lambda self, key, _get=ShardReader.get: read_whole.append(key)
                        or _get(self, key))
    model = build_skeleton(source.hf_config, torch.float32)
    embed = get_submodule(model, source.spec.embed)
    embed.padding_idx = 498  # an id past the distinct tokens' rows: only gradients read it, the capture must not
    got = pipeline._first_layer_inputs(model, source.reader, source.spec, input_ids, torch.device("cpu"))

    assert_same(got, expected)
    assert f"{source.spec.embed}.weight" not in read_whole
    assert embed.weight.is_meta and embed.padding_idx == 498  # dropped after the pass, the module as it was
