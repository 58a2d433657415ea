"""The bf16 kernel benchmark's pieces: the decode step's linear shapes and the switch that loads oneDNN's linears."""

import pytest
import torch

from bf16_dot import onednn_linears, step_shapes
from quantkit.bench.engine_vs_vllm import SHAPE
from quantkit.kernels import bf16_cpu


def test_step_shapes_are_the_fused_linears_of_the_benchmark_model():
    shapes = step_shapes()
    assert len(shapes) == 4 * SHAPE["num_hidden_layers"] + 1
    assert shapes[:4] == [(2048, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]  # q/k/v (8 KV heads), o, gate/up, down
    assert shapes[-1] == (32000, 1024)
    assert 2 * sum(n * k for n, k in shapes) / 2**20 == pytest.approx(242.5, abs=0.1)  # the engine's float linears


@pytest.mark.skipif(not bf16_cpu.bf16_dot_available(), reason="the bf16 dot kernel needs AVX-512 BF16 (none here)")
def test_onednn_switch_changes_what_loads_and_is_restored(tiny_llama):
    from quantkit.engine import LLM
    from quantkit.kernels.cpu_linear import PrepackedLinear

    with onednn_linears():
        assert not bf16_cpu.bf16_dot_available()
        theirs = LLM(str(tiny_llama), dtype="bfloat16", max_model_len=64).engine.model
    ours = LLM(str(tiny_llama), dtype="bfloat16", max_model_len=64).engine.model
    assert isinstance(theirs.model.layers[0].mlp.down_proj, PrepackedLinear)
    assert isinstance(ours.model.layers[0].mlp.down_proj, bf16_cpu.Bf16DotLinear)
    x = torch.randn(3, ours.model.layers[0].mlp.down_proj.in_features).bfloat16()
    a, b = ours.model.layers[0].mlp.down_proj(x), theirs.model.layers[0].mlp.down_proj(x)
    torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-3)  # the same linear, two kernels


@pytest.mark.skipif(not bf16_cpu.bf16_dot_available() or not bf16_cpu.extension().has_amx(),
                    reason="the AMX path needs a CPU with AMX-BF16 whose Linux grants the tiles (none here)")
def test_amx_switch_turns_the_tiles_off_within_the_block_and_back_on():
    from bf16_dot import amx_switched

    ext = bf16_cpu.extension()
    with amx_switched(False):
        assert ext.dev.set_amx(False) is False  # off inside (set_amx returns the previous setting)
    assert ext.dev.set_amx(True) is True  # restored on leaving
