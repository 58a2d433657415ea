"""One layer's turn in the pipeline (quantkit/quant/layer_step.py): the finiteness check of the tensors it reads."""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.quant.layer_step import all_finite, check_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_nan_or_inf_anywhere_is_found(dtype):
    w = torch.randn(64, 96).to(dtype)
    assert all_finite(w)
    for bad in (float("nan"), float("inf"), float("-inf")):
        v = w.clone()
        v[37, 5] = bad
        assert not all_finite(v)
    both = w.clone()
    both[0, 0], both[1, 1] = float("inf"), float("-inf")  # a sum of inf and -inf: NaN, not finite either
    assert not all_finite(both)


def test_finite_values_whose_sum_leaves_fp32s_range_are_finite():
    w = torch.full((8, 8), 3e38)  # each finite, their sum inf: checked element by element
    assert not torch.isfinite(w.sum()) and all_finite(w)
    assert all_finite(torch.full((4,), 60000.0, dtype=torch.float16))  # summed in fp32: past fp16's range is fine


def test_a_non_finite_tensor_is_named_in_one_line():
    with pytest.raises(QuantkitError, match=r"^model\.layers\.3\.mlp\.up_proj\.weight: weights contain NaN or inf$"):
        check_finite({"mlp.up_proj.weight": torch.tensor([1.0, float("nan")])}, "model.layers.3")
