"""The engine's decoder against transformers: RoPE frequencies (default, linear, llama3), and greedy
parity on tiny models with scaled RoPE and on the Mistral family."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from quantkit.engine import LLM, SamplingParams
from quantkit.engine.rope import apply_rope, cos_sin, inv_frequencies, rope_parameters
from quantkit.errors import QuantkitError

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("name", ["default", "linear", "llama3"])
def test_inv_frequencies_match_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = SCALINGS.get(name, {"rope_type": "default", "rope_theta": 10000.0})
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=512, rope_parameters=params)
    ours = inv_frequencies(rope_parameters(cfg), 32, 512)
    if name == "default":
        want = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[name](cfg, "cpu")
    torch.testing.assert_close(ours, want, rtol=0, atol=0)


def test_unknown_rope_type_is_refused():
    with pytest.raises(QuantkitError, match="unsupported RoPE type 'yarn'"):
        inv_frequencies({"rope_type": "yarn", "rope_theta": 1e4}, 32, 512)


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
