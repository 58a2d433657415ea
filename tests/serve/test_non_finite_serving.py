"""`quantkit serve` on checkpoints whose numbers are not finite: 4-bit scales with NaN are refused at load in one
line naming the layer (exit 2, no traceback); logits that come out NaN fail the request (500, or an error event
in a stream), never come back as text."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from quantkit.cli import build_app
from tests_support.corrupt import corrupt, nan_every_seventh
from tests_support.serving import serve_in_thread, serve_until_it_exits, settings_for

LAYER = "model.layers.1.mlp.down_proj"


def test_serve_refuses_nan_scales_in_one_line(tiny_llama, tmp_path):
    rtn = tmp_path / "rtn"
    done = CliRunner().invoke(build_app(), ["quantize", str(tiny_llama), "--method", "rtn", "--group-size", "32",
                                            "--out", str(rtn)])
    assert done.exit_code == 0, done.output
    bad = corrupt(rtn, tmp_path / "bad", f"{LAYER}.scales", nan_every_seventh)
    code, output = serve_until_it_exits(bad, timeout=300)
    assert code == 2, output
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert errors and all(f"{LAYER}.scales" in line and "NaN or inf" in line for line in errors), output
    assert errors[-1].startswith("error: ") and "Traceback" not in output


@pytest.fixture(scope="module")
def nan_server(tiny_llama, tmp_path_factory):
    bad = corrupt(tiny_llama, tmp_path_factory.mktemp("nan") / "m", "model.norm.weight", nan_every_seventh)
    with serve_in_thread(settings_for(bad, served_model_names=("m",))) as running:
        yield running


def test_nan_logits_are_an_error_not_text(nan_server):
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{nan_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 500 and "non-finite logits" in r.json()["error"]["message"], r.text
    # streamed: the prefill's logits are already NaN, so the failure comes before any header: a 500 as well
    with httpx.stream("POST", f"{nan_server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 500 and "non-finite logits" in json.loads(s.read())["error"]["message"]
    assert httpx.get(f"{nan_server.url}/health", timeout=10).status_code == 200  # the server goes on
