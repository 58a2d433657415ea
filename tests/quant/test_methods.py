"""quantkit.quant.pipeline.make_method: one list of method names (quantkit.config.METHODS), plain lazy imports."""

import subprocess
import sys

import pytest
import torch

from quantkit.config import METHODS, QuantizeConfig
from quantkit.errors import QuantkitError
from quantkit.quant.pipeline import METHOD_CLASSES, make_method


@pytest.mark.parametrize("name", METHODS)
def test_every_configured_method_is_built(tmp_path, name):
    method = make_method(QuantizeConfig(model="m", out=tmp_path / "o", method=name))
    assert method.name == name
    assert callable(method.quantize_layer)


def test_every_configured_method_has_one_entry_in_the_table():
    assert tuple(METHOD_CLASSES) == METHODS


def test_an_unknown_method_is_refused_by_the_config(tmp_path):
    with pytest.raises(QuantkitError, match=r"unknown method 'squeezellm'; expected one of rtn, gptq, awq"):
        QuantizeConfig(model="m", out=tmp_path / "o", method="squeezellm")


def test_the_pipeline_imports_no_method_until_asked():
    code = ("import sys, quantkit.quant.pipeline; "
            "print(sorted(m for m in ('quantkit.quant.rtn', 'quantkit.quant.gptq_layer', 'quantkit.quant.awq') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_runs_compute_in_the_context_dtype_and_return_fp32(tiny_llama, tmp_path, dtype):
    """bf16 runs: the linears compute in bf16, the weights stay fp32, the outputs come back fp32 and
    close to the fp32 run's; fp32 runs are unchanged."""
    from transformers import AutoModelForCausalLM

    from quantkit.format.arch import spec_for
    from quantkit.format.primitives import QuantScheme
    from quantkit.quant.methods import LayerContext

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    layer = model.model.layers[0]
    x = torch.randn(2, 16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).unsqueeze(0)
    kwargs = {"position_embeddings": model.model.rotary_emb(x, pos), "attention_mask": None, "position_ids": pos}
    ctx = LayerContext(index=0, layer=layer, spec=spec_for(model.config), model_config=model.config, inputs=[x],
                       layer_kwargs=kwargs, scheme=QuantScheme(4, 32, True),
                       config=QuantizeConfig(model="m", out=tmp_path / "o"), linears=(), skipped={},
                       compute_dtype=dtype)
    seen, cached = [], []

    def hook(_module, _args, out) -> None:
        seen.append(out.dtype)
        cached.append(torch.is_autocast_cache_enabled())

    handle = layer.self_attn.q_proj.register_forward_hook(hook)
    try:
        out = ctx.run_layer()[0]
    finally:
        handle.remove()
    assert cached == [False]  # no bf16 copy of each weight held beside the fp32 layer for the whole pass
    with torch.no_grad():
        ref = layer(x, **kwargs)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert seen == [dtype]  # the matmul ran in the context's dtype
    assert layer.self_attn.q_proj.weight.dtype == torch.float32 and out.dtype == torch.float32
    if dtype == torch.float32:
        assert torch.equal(out, ref)
    else:
        assert not torch.equal(out, ref)
        torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)
