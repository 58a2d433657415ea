"""The engine's decoder against transformers: RoPE frequencies (default, linear, llama3, yarn), and greedy
parity on tiny models with scaled RoPE and on the Mistral family."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from quantkit.engine import LLM, SamplingParams
from quantkit.engine.rope import apply_rope, attention_factor, cos_sin, inv_frequencies, rope_parameters
from quantkit.errors import QuantkitError

pytestmark = pytest.mark.usefixtures("cpu_level")  # every test at each CPU level this machine runs (conftest.py)

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    # gpt-oss's (untruncated ramp), and one with a truncated ramp and mscale / mscale_all_dim
    "yarn": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "original_max_position_embeddings": 4096, "rope_theta": 150000.0, "truncate": False},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0,
                    "mscale_all_dim": 0.5, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn", "yarn-mscale"])
def test_inv_frequencies_match_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = SCALINGS.get(name, {"rope_type": "default", "rope_theta": 10000.0})
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=512, rope_parameters=params)
    ours = inv_frequencies(rope_parameters(cfg), 32, 512)
    factor = 1.0
    if name == "default":
        want = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    else:
        want, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    torch.testing.assert_close(ours, want, rtol=0, atol=0)
    assert attention_factor(rope_parameters(cfg)) == factor  # transformers' attention_scaling of cos and sin
    assert (factor != 1.0) == name.startswith("yarn")


def test_unknown_rope_type_is_refused():
    with pytest.raises(QuantkitError, match="unsupported RoPE type 'longrope'"):
        inv_frequencies({"rope_type": "longrope", "rope_theta": 1e4}, 32, 512)


def test_apply_rope_matches_transformers_rotation():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = torch.randn(5, 4, 16)
    inv = inv_frequencies({"rope_type": "default", "rope_theta": 10000.0}, 16, 64)
    cos, sin = cos_sin(inv, torch.arange(3, 8), torch.float32)
    q_hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(apply_rope(x, cos, sin), q_hf[0].transpose(0, 1))


def _greedy_pair(path, prompts, max_tokens=12):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            want.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                    do_sample=False)[0, len(p):].tolist())
    llm = LLM(str(path), max_model_len=256, max_num_seqs=8, dtype="float32")  # token-identical is an fp32 claim
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))]
    return got, want


PROMPTS = [[1] + list(range(5 + 3 * i, 5 + 3 * i + 10 + 17 * i)) for i in range(6)]  # up to ~100 tokens


@pytest.mark.parametrize("name", ["linear", "llama3"])
def test_scaled_rope_greedy_matches_transformers(name, tiny_llama, tmp_path):
    path = tmp_path / name
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = SCALINGS[name]
    cfg.pop("rope_scaling", None)
    (path / "config.json").write_text(json.dumps(cfg))
    got, want = _greedy_pair(path, PROMPTS)
    assert got == want


def test_mistral_greedy_matches_transformers(tmp_path):
    from tests_support.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "mistral", family="mistral")
    got, want = _greedy_pair(path, PROMPTS)
    assert got == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_table_path_gives_the_tokens_of_per_step_cos_sin(tiny_llama, monkeypatch, dtype):
    """On CPU the engine holds cos | sin by position for its max_model_len and the attention block rotates and
    writes the cache in one op from the table; without the table each step computes cos and sin: same tokens."""
    from quantkit.engine.rope import rope_table
    from quantkit.kernels import cpu_fused

    llm = LLM(str(tiny_llama), dtype=dtype, max_model_len=96, max_num_seqs=4)
    model = llm.engine.model
    assert model.rope_limit == 96 and model.rope_table is None  # built at the first step, for what it needs
    calls = []
    fused = cpu_fused.rope_and_cache
    monkeypatch.setattr(cpu_fused, "rope_and_cache", lambda *a: calls.append(1) or fused(*a))
    prompts = [[1, 5, 9, 200, 7], [1, 300, 4], list(range(3, 60))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with_table = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls or not cpu_fused.available(torch.zeros(1, dtype=getattr(torch, dtype)))
    assert torch.equal(model.rope_table, rope_table(model.inv_freq, 96, getattr(torch, dtype)))  # 256 capped at 96
    model.rope_limit, calls[:] = None, []
    assert with_table == [o.outputs[0].token_ids for o in llm.generate(prompts, params)] and not calls


def test_rope_table_grows_by_doubling_up_to_the_limit(tiny_llama):
    from quantkit.engine.rope import rope_table

    model = LLM(str(tiny_llama), dtype="float32", max_model_len=500).engine.model
    assert model._rope_rows(10, torch.float32).shape[0] == 256 and model._rope_rows(256, torch.float32).shape[0] == 256
    assert model._rope_rows(257, torch.float32).shape[0] == 500  # 512, capped at the limit
    assert torch.equal(model.rope_table, rope_table(model.inv_freq, 500, torch.float32))
    assert model._rope_rows(501, torch.float32) is None  # past the limit: cos and sin per step
