"""The embeddings tests' oracle: transformers' own forward of a checkpoint, its final hidden state pooled."""

from __future__ import annotations

import torch


def pooled_reference(model_dir, prompts: list[list[int]], pooling: str) -> torch.Tensor:
    """transformers' last_hidden_state (after the final norm) of each prompt, pooled by "last" or "mean", then
    L2-normalized: [P, hidden] fp32."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        states = [hf(torch.tensor([p])).last_hidden_state[0] for p in prompts]  # each [len, hidden]
    pooled = torch.stack([s[-1] if pooling == "last" else s.mean(dim=0) for s in states])
    return torch.nn.functional.normalize(pooled, dim=-1)
