"""The engine on a GPU (`pytest -m gpu`; `bash kernels/gpu_check.sh` runs it): greedy tokens against
transformers' generate on the same device, in fp32, with the Triton paged decode attention doing
the decodes. `gpu_check --dry-run` runs it on CPU tensors, decodes through the kernel in the
interpreter (quantkit.bench.gpu_steps.counting_paged_attention)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

TIE = 1e-3  # logit margin under which fp32 reduction order may flip the greedy choice


def hf_greedy_with_margins(path, prompts, device, max_tokens) -> list[tuple[list[int], list[float]]]:
    """For each prompt: HF's greedy tokens and, at each step, the top-1 minus top-2 logit."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            top2 = [s[0].float().topk(2).values for s in gen.scores]
            outs.append((gen.sequences[0, len(p):].tolist(), [float(t[0] - t[1]) for t in top2]))
    return outs


def test_engine_greedy_matches_transformers_on_the_device(gpu_device, tiny_llama):
    from quantkit.bench.gpu_steps import counting_paged_attention
    from quantkit.engine import LLM, SamplingParams

    on_gpu = gpu_device.type == "cuda"  # the dry run's interpreter takes seconds per kernel call: fewer there
    lengths, max_tokens = ((3, 17, 40, 9), 8) if on_gpu else ((3, 17), 3)
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    with counting_paged_attention(gpu_device) as calls:
        llm = LLM(str(tiny_llama), device=gpu_device.type, dtype="float32", max_num_seqs=4, max_model_len=128)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    assert calls[0] > 0  # the decodes went through the Triton kernel
    for out, (want, margins) in zip(outs, hf_greedy_with_margins(tiny_llama, prompts, gpu_device, max_tokens)):
        got = out.outputs[0].token_ids
        first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first_diff is not None:  # only a near tie may differ, and everything after it follows
            assert margins[first_diff] < TIE, (got, want, margins)
        else:
            assert got == want
