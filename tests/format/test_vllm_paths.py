"""vLLM kernel-path rules per packed linear, and tensor-parallel splits."""

import pytest

from quantkit.format.vllm_paths import PackedShape, fast_path_report, marlin_reason, split_reason


def layer(name="model.layers.0.mlp.up_proj", n=11008, k=4096, bits=4, g=128, sym=True, fmt="gptq", declared=True):
    return PackedShape(name, n, k, bits, g, sym, fmt, declared)


@pytest.mark.parametrize("kwargs,reason", [
    ({}, None),
    ({"g": -1}, None),
    ({"bits": 8, "g": 32}, None),
    ({"fmt": "awq", "sym": False}, None),
    ({"fmt": "compressed-tensors", "sym": False}, None),
    ({"declared": False}, "no `sym`"),
    ({"sym": False}, "asymmetric GPTQ"),
    ({"fmt": "awq", "bits": 8, "sym": False}, "8-bit AWQ"),
    ({"fmt": "compressed-tensors", "sym": False, "bits": 8}, "asymmetric 8-bit"),
    ({"g": 256}, "group size 256"),
    ({"n": 11008 + 32}, "N=11040 not a multiple of 64"),
    ({"name": "model.layers.0.mlp.down_proj", "n": 4096, "k": 11008 + 64}, "K=11072 not a multiple of 128"),
])
def test_marlin_rules(kwargs, reason):
    got = marlin_reason(layer(**kwargs))
    assert got is None if reason is None else reason in got


def test_row_parallel_layers_split_along_k_on_group_boundaries():
    down = layer("model.layers.0.mlp.down_proj", n=4096, k=11008)  # 11008 = 86 x 128
    assert split_reason(down, 2) is None  # 5504 = 43 groups
    assert "K/4=2752 not a multiple of group size 128" in split_reason(down, 4)
    assert split_reason(layer("model.layers.0.mlp.down_proj", n=4096, k=11008, g=-1), 4) is None
    up = layer(n=11008, k=4096)
    assert split_reason(up, 4) is None and "N/256=43" in split_reason(up, 256)


def test_report_names_fallbacks_and_tp_problems():
    layers = [layer("model.layers.0.self_attn.q_proj", n=4096, k=4096),
              layer("model.layers.0.mlp.down_proj", n=4096, k=11008),
              layer("model.layers.0.self_attn.k_proj", n=96, k=4096)]  # N=96: not Marlin-shaped
    report = fast_path_report(layers, (2, 4, 8))
    assert report.fallbacks == {"model.layers.0.self_attn.k_proj": "N=96 not a multiple of 64"}
    assert report.tp[2] == {}  # k_proj already falls back at tp 1; it is reported there, not again
    assert "group size 128" in report.tp[4]["model.layers.0.mlp.down_proj"]
    # q_proj splits at 8 (512 columns a GPU) and keeps Marlin; at 128 it would fall off (N=32)
    assert "model.layers.0.self_attn.q_proj" not in report.tp[8]
    assert "falls off Marlin: N=32" in fast_path_report(layers[:1], (128,)).tp[128]["model.layers.0.self_attn.q_proj"]
