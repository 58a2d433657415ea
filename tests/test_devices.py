"""quantkit.devices: one spelling of device names for quantize, check, eval and the engine."""

import pytest
import torch

from quantkit.config import QuantizeConfig
from quantkit.devices import check_device_name, resolve_device
from quantkit.engine.config import EngineConfig
from quantkit.errors import QuantkitError


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_accepted_names(name):
    check_device_name(name)


@pytest.mark.parametrize("name", ["tpu", "CUDA", "cuda:", "cuda:-1", "cuda:1x", "cpu:0", "", "mps"])
def test_refused_names_are_one_line_errors(name):
    with pytest.raises(QuantkitError, match=r"^unknown device .*; expected auto, cpu, cuda or cuda:N$"):
        resolve_device(name)


def test_cpu_and_auto_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(QuantkitError, match="device cuda:0: torch sees no CUDA device"):
        resolve_device("cuda:0")


def test_cuda_index_checked_against_device_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(QuantkitError, match=r"device cuda:2: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_configs_accept_the_same_names():
    # quantize took cuda:1 while the engine refused it: both configs now validate through check_device_name
    assert EngineConfig("m", device="cuda:1").device == "cuda:1"
    assert QuantizeConfig(model="m", out="o", device="cuda:1").device == "cuda:1"
    for build in (lambda: EngineConfig("m", device="gpu"), lambda: QuantizeConfig(model="m", out="o", device="gpu")):
        with pytest.raises(QuantkitError, match="unknown device 'gpu'"):
            build()


def test_compute_dtype_auto_is_bf16_only_where_the_device_computes_it():
    from quantkit.devices import compute_dtype

    cpu = torch.device("cpu")
    assert compute_dtype("auto", cpu, {"avx512_bf16": True})[0] == torch.bfloat16
    assert compute_dtype("auto", cpu, {"amx_bf16": True})[0] == torch.bfloat16
    dtype, why = compute_dtype("auto", cpu, {"avx2": True, "avx512_f": True})
    assert dtype == torch.float32 and "emulated" in why
    assert compute_dtype("float32", cpu, {"avx512_bf16": True})[0] == torch.float32
    assert compute_dtype("bfloat16", cpu, {})[0] == torch.bfloat16


def test_an_unknown_compute_dtype_is_a_one_line_error(tmp_path):
    with pytest.raises(QuantkitError, match=r"^unknown --compute-dtype 'fp16'; expected one of auto, float32, bfloat16$"):
        QuantizeConfig(model="m", out=tmp_path / "o", compute_dtype="fp16")
