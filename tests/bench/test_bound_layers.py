"""The bound-path benchmark's measurement on a tiny model: both paths timed each round, the logits checked first."""

from __future__ import annotations

import pytest

from quantkit.bench.bound_layers import compare
from quantkit.engine import LLM, decoder


def test_compare_times_both_paths_and_restores_the_binding(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256, max_num_seqs=4)
    bound = llm.engine.model.bound_layers
    fast, slow = compare(llm, batch=4, rounds=3, steps=2)
    assert len(fast) == len(slow) == 3 and min(fast + slow) > 0
    assert llm.engine.model.bound_layers is bound


def test_compare_refuses_paths_whose_logits_differ(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256, max_num_seqs=2)
    original = decoder.bound_layers_forward

    def off_by_a_bit(*args):
        x, residual = original(*args)
        return x * 1.001, residual

    monkeypatch.setattr(decoder, "bound_layers_forward", off_by_a_bit)
    with pytest.raises(SystemExit, match="different logits"):
        compare(llm, batch=2, rounds=1, steps=1)
