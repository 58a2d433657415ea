"""Embeddings through the engine's own forward (`LLM.embed`), against transformers' final hidden state (after the
final norm) pooled the same way, on the tiny random models: chunked prefill, beside generation in one batch, a prefix
hit, recompute, and a 4-bit checkpoint's kernels."""

from __future__ import annotations

import pytest
import torch

from quantkit.engine import LLM, SamplingParams
from quantkit.engine.pooling import PoolingParams, PoolingState, pooled_rows
from quantkit.errors import QuantkitError
from tests_support.pooled_reference import pooled_reference

PROMPTS = [[1, 17, 33, 250, 9], [1] + list(range(40, 90)), [1, 7] * 20, [5]]


def embed(llm: LLM, prompts, pooling: str) -> torch.Tensor:
    return torch.tensor([o.embedding for o in llm.embed(prompts, pooling=pooling)])


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_matches_transformers_pooled_final_state(tiny_llama, pooling):
    # 16 tokens a step: the 51-token prompt runs in 4 chunks, the others beside it
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, max_num_batched_tokens=16, num_threads=1)
    got = embed(llm, PROMPTS, pooling)
    want = pooled_reference(tiny_llama, PROMPTS, pooling)
    assert got.shape == want.shape == (len(PROMPTS), 128)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(PROMPTS)))
    assert llm.engine.kv.num_free_blocks == llm.engine.kv_plan.num_blocks  # every block back


def test_embeddings_beside_generation_and_after_a_prefix_hit(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), dtype="float32", max_model_len=128, max_num_batched_tokens=32, num_threads=1,
              block_size=4)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8)
    alone = llm.generate([PROMPTS[1]], greedy)[0].outputs[0].token_ids  # also caches PROMPTS[1]'s blocks
    hits = engine.kv.prefix_stats.hits
    gen = engine.add_request(PROMPTS[1], greedy)
    emb_last = engine.add_request(PROMPTS[1], PoolingParams("last"))  # a prefix hit: only the tail runs
    emb_mean = engine.add_request(PROMPTS[1], PoolingParams("mean"))  # no hit: every state is pooled
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step(finished_only=True))
    assert outs[gen].outputs[0].token_ids == alone and outs[gen].embedding is None
    assert engine.kv.prefix_stats.hits > hits
    want = pooled_reference(tiny_qwen2, [PROMPTS[1]], "last")[0]
    torch.testing.assert_close(outs[emb_last].embedding, want, atol=2e-5, rtol=1e-4)
    want = pooled_reference(tiny_qwen2, [PROMPTS[1]], "mean")[0]
    torch.testing.assert_close(outs[emb_mean].embedding, want, atol=2e-5, rtol=1e-4)
    assert outs[emb_last].outputs[0].token_ids == [] and outs[emb_last].outputs[0].finish_reason == "stop"


def test_mean_pool_restarts_after_a_recompute():
    pool = PoolingState(PoolingParams("mean", normalize=False))
    pool.add(torch.ones(3, 2))
    pool.reset()  # preempted by recompute: the chunk at position 0 runs again
    pool.add(torch.tensor([[1.0, 3.0], [3.0, 5.0]]))
    assert pool.result().tolist() == [2.0, 4.0]


@pytest.mark.parametrize("pooling, start, n, prompt_len, rows", [
    ("mean", 4, 3, 10, range(4, 7)),
    ("last", 0, 4, 10, range(0)),  # the last prompt token is in a later chunk
    ("last", 8, 2, 10, range(9, 10)),
])
def test_pooled_rows(pooling, start, n, prompt_len, rows):
    assert pooled_rows(PoolingParams(pooling), start, n, prompt_len) == rows


def test_bad_input_is_one_line(tiny_llama):
    with pytest.raises(QuantkitError, match="pooling 'cls'"):
        PoolingParams("cls")
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=16, num_threads=1)
    with pytest.raises(QuantkitError, match="more than max_model_len 16"):
        llm.embed([list(range(3, 30))])


@pytest.mark.slow
def test_embed_on_a_4bit_checkpoint_matches_its_dequantized_weights(tiny_llama, tmp_path_factory):
    """The 4-bit kernels' pooled state against transformers running the same weights dequantized to float."""
    from tests_support.dequantized import dequantized_copy
    from tests_support.int4_checkpoints import quantize_tiny

    qdir = quantize_tiny(tiny_llama, tmp_path_factory, "rtn", "gptq", 64)
    llm = LLM(str(qdir), dtype="float32", max_model_len=128, num_threads=1, cpu_int8_prefill=False)  # W4A16
    assert llm.engine.quant_info is not None
    got = embed(llm, PROMPTS, "mean")
    want = pooled_reference(dequantized_copy(qdir, tmp_path_factory.mktemp("deq")), PROMPTS, "mean")
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-3)
