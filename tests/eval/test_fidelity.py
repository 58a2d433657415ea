"""Fidelity to the float model: KL(float || quant) per token and top-1 agreement, against the definitions and on
stories260K-hf (real trained weights) with its attention linears round-to-nearest quantized."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from quantkit.eval.fidelity import FloatReference, score, token_kl, top1_matches
from quantkit.eval.perplexity import perplexity, tokenize_once
from quantkit.format.primitives import QuantScheme, rtn_quantize
from quantkit.model.loader import load_model, load_tokenizer

SEQLEN, TOKENS = 128, 3000


def test_token_kl_is_the_definition_and_zero_probabilities_add_nothing():
    gen = torch.Generator().manual_seed(0)
    ref = F.log_softmax(torch.randn(3, 5, 40, generator=gen), -1)
    other = F.log_softmax(torch.randn(3, 5, 40, generator=gen), -1)
    expected = F.kl_div(other, ref, log_target=True, reduction="none").sum(-1)  # torch's own KL(ref || other)
    torch.testing.assert_close(token_kl(ref, other), expected)
    assert torch.equal(token_kl(ref, ref), torch.zeros(3, 5))
    ref[..., 0] = float("-inf")  # a token the reference never predicts: its term is 0, not nan
    assert torch.isfinite(token_kl(ref, other)).all()


def test_top1_matches_compares_the_argmaxes():
    a = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2]]).log()
    b = torch.tensor([[0.2, 0.6, 0.2], [0.2, 0.3, 0.5]]).log()
    assert top1_matches(a, b).tolist() == [True, False]


@pytest.fixture(scope="module")
def stories(stories_dir, wikitext_test):
    model, _ = load_model(stories_dir)
    ids, note = tokenize_once(load_tokenizer(stories_dir), wikitext_test.read_text(encoding="utf-8"))
    return model, ids[:TOKENS], note


@pytest.fixture(scope="module")
def quantized(stories):
    """stories260K-hf with every attention linear replaced by its asymmetric 4-bit g64 RTN weight."""
    model = copy.deepcopy(stories[0])
    scheme = QuantScheme(bits=4, group_size=64, sym=False)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                mod.weight.copy_(rtn_quantize(mod.weight, scheme).dequantize())
    return model


def reference_fidelity(model, float_model, ids: torch.Tensor) -> tuple[float, float]:
    """The plain loop: one window at a time, torch's kl_div per position, argmaxes compared."""
    kls, agree, n = [], 0, 0
    for i in range(len(ids) // SEQLEN):
        window = ids[i * SEQLEN:(i + 1) * SEQLEN][None]
        with torch.no_grad():
            q = F.log_softmax(model(window).logits[0, :-1].float(), -1)
            f = F.log_softmax(float_model(window).logits[0, :-1].float(), -1)
        kls.append(float(F.kl_div(q, f, log_target=True, reduction="sum")))
        agree += int((q.argmax(-1) == f.argmax(-1)).sum())
        n += SEQLEN - 1
    return sum(kls) / n, agree / n


@pytest.mark.usefixtures("one_torch_thread")
def test_the_float_model_against_itself_has_kl_zero_and_agrees_everywhere(stories):
    model, ids, note = stories
    ref = FloatReference(model, ids, SEQLEN)
    fid = score(model, ref)
    assert (fid.kl, fid.top1, fid.predictions) == (0.0, 1.0, (TOKENS // SEQLEN) * (SEQLEN - 1))
    # the reference's perplexity and the scored one are perplexity()'s, to the last bit
    assert fid.ppl == ref.ppl == perplexity(model, ids, SEQLEN, "wikitext2", note).ppl


@pytest.mark.usefixtures("one_torch_thread")
def test_a_quantized_model_is_scored_as_the_plain_loop_scores_it(stories, quantized):
    model, ids, note = stories
    ref = FloatReference(model, ids, SEQLEN)
    fid = score(quantized, ref)
    kl, top1 = reference_fidelity(quantized, model, ids)
    assert fid.kl > 1e-4 and fid.top1 < 1.0  # 4-bit attention moves the distribution and flips some argmaxes
    assert fid.kl == pytest.approx(kl, rel=1e-5) and fid.top1 == top1
    assert fid.ppl == perplexity(quantized, ids, SEQLEN, "wikitext2", note).ppl


@pytest.mark.usefixtures("one_torch_thread")
def test_a_reference_over_its_memory_budget_recomputes_and_gives_the_same_figures(stories, quantized):
    model, ids, _ = stories
    kept, recomputed = FloatReference(model, ids, SEQLEN), FloatReference(model, ids, SEQLEN, budget_bytes=0)
    assert kept.kept == len(kept.batches) and recomputed.kept == 0
    assert score(quantized, recomputed) == score(quantized, kept)
