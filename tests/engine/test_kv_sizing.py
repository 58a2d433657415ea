"""KV pool sizing from num_kv_blocks / kv_cache_memory / the CPU default, and the start-up refusal."""

from __future__ import annotations

import pytest
import torch

from quantkit.engine.config import GiB, EngineConfig
from quantkit.engine.kv_sizing import plan_kv
from quantkit.engine.model_runner import kv_block_bytes
from quantkit.errors import QuantkitError

CPU = torch.device("cpu")


def test_block_bytes_counts_keys_values_and_layers():
    # stories260K: 5 layers, 4 kv heads of 8, fp32, 16 tokens a block
    assert kv_block_bytes(5, 16, 4, 8, torch.float32) == 2 * 5 * 16 * 4 * 8 * 4 == 20480
    assert kv_block_bytes(5, 16, 4, 8, torch.bfloat16) == 10240


def test_blocks_from_each_knob():
    bb = 20480
    assert plan_kv(EngineConfig("m", num_kv_blocks=40), bb, 512, CPU).num_blocks == 40
    plan = plan_kv(EngineConfig("m", kv_cache_memory=2 * 1024**2), bb, 512, CPU)
    assert (plan.num_blocks, plan.capacity_tokens) == (102, 1632)
    # default: 1 GiB, capped at max_num_seqs full-length sequences
    assert plan_kv(EngineConfig("m", max_num_seqs=4), bb, 512, CPU).num_blocks == 4 * 32
    assert plan_kv(EngineConfig("m", swap_space=0.001), bb, 512, CPU).num_swap_blocks == int(0.001 * GiB) // bb
    assert "102 blocks x 16 tokens = 1632 tokens (2.0 MiB)" in plan.describe()


def test_refuses_a_pool_smaller_than_one_max_length_request():
    with pytest.raises(QuantkitError, match=r"KV pool too small: 31 blocks of 16 tokens \(496 tokens, 0\.6 MiB\) "
                                            r"cannot hold one request of max_model_len=512 \(needs 32 blocks"):
        plan_kv(EngineConfig("m", num_kv_blocks=31), 20480, 512, CPU)
    assert plan_kv(EngineConfig("m", num_kv_blocks=32), 20480, 512, CPU).num_blocks == 32


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 0}, "block_size"),
    ({"swap_space": -1}, "swap_space"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"dtype": "int8"}, "unknown dtype"),
    ({"device": "tpu"}, "unknown device"),
    ({"max_model_len": 1}, "max_model_len"),
])
def test_engine_config_validation(kwargs, match):
    with pytest.raises(QuantkitError, match=match):
        EngineConfig("m", **kwargs)


def test_auto_cpu_dtype_is_bf16_only_where_the_cpu_computes_it():
    from quantkit.devices import auto_cpu_dtype

    assert auto_cpu_dtype({"avx512_bf16": True, "avx2": True})[0] == "bfloat16"
    assert auto_cpu_dtype({"amx_bf16": True})[0] == "bfloat16"
    name, why = auto_cpu_dtype({"avx2": True, "avx512_f": True})
    assert name == "float32" and "neither" in why
