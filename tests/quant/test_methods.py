"""quantkit.quant.methods.make_method: one list of method names (quantkit.config.METHODS), plain lazy imports."""

import subprocess
import sys

import pytest

from quantkit.config import METHODS, QuantizeConfig
from quantkit.errors import QuantkitError
from quantkit.quant.methods import make_method


@pytest.mark.parametrize("name", METHODS)
def test_every_configured_method_is_built(tmp_path, name):
    method = make_method(QuantizeConfig(model="m", out=tmp_path / "o", method=name))
    assert method.name == name
    assert callable(method.quantize_layer)


def test_an_unknown_method_is_refused_by_the_config(tmp_path):
    with pytest.raises(QuantkitError, match=r"unknown method 'squeezellm'; expected one of rtn, gptq, awq"):
        QuantizeConfig(model="m", out=tmp_path / "o", method="squeezellm")


def test_the_pipeline_imports_no_method_until_asked():
    code = ("import sys, quantkit.quant.pipeline; "
            "print(sorted(m for m in ('quantkit.quant.rtn', 'quantkit.quant.gptq_layer', 'quantkit.quant.awq') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
