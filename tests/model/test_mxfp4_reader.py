"""A gpt-oss checkpoint with MXFP4 experts (as OpenAI ships it) read as the float checkpoint it stands for: each
blocks/scales pair as one stacked bf16 tensor, the rest as stored; transformers' own reading of that checkpoint is the
float twin's model (so the test's encoder writes the real layout)."""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.model.mxfp4_reader import Mxfp4Reader
from quantkit.model.quant_format import read_quant_info
from quantkit.model.source import open_model


@pytest.fixture(scope="module")
def twin(tiny_family, tmp_path_factory):
    from tests_support.mxfp4 import mxfp4_twin

    return mxfp4_twin(tiny_family("gpt_oss"), tmp_path_factory.mktemp("mxfp4"))


def test_blocks_and_scales_read_as_the_stacked_float_tensor(twin):
    from safetensors.torch import load_file

    mx, float_dir = twin
    source = open_model(mx)
    assert isinstance(source.reader.base, Mxfp4Reader)  # then read one linear per expert (stacked_experts)
    assert source.quant is None and read_quant_info(source.config) is None
    reader = Mxfp4Reader(mx)
    want = load_file(str(float_dir / "model.safetensors"))
    assert sorted(reader.keys()) == sorted(want)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert key in reader and f"{key}_blocks" not in reader
    assert reader.shape_of(key) == tuple(want[key].shape) and reader.dtype_of(key) == torch.bfloat16
    assert torch.equal(reader.get(key).float(), want[key])
    assert torch.equal(reader.get(f"{key}_bias"), want[f"{key}_bias"])
    with pytest.raises(QuantkitError, match="stored as MXFP4 and is read dequantized"):
        reader.mapped(key)
    experts = torch.tensor([2, 0])  # some experts' rows: only their blocks read
    assert torch.equal(reader.rows(key, experts).float(), want[key][experts])


def test_transformers_reads_the_mxfp4_checkpoint_as_its_float_twin(twin):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    mx, float_dir = twin
    ref = AutoModelForCausalLM.from_pretrained(str(mx), dtype=torch.float32,
                                               quantization_config=Mxfp4Config(dequantize=True)).eval()
    ours = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32).eval()
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, ours(ids).logits)
