"""Capturing what the first decoder layer sees: hidden states per calibration sample and the
keyword arguments (RoPE cos/sin, mask, positions) the model passes to every layer."""

from __future__ import annotations

import torch
from torch import nn


BATCH_TOKENS = 4096  # tokens per call of a decoder layer: samples are run together up to this many


class _Captured(Exception):
    """Raised by the pre-hook to stop the forward pass at layer 0 (the other layers are not loaded)."""


def capture_layer_inputs(base_model: nn.Module, first_layer: nn.Module, input_ids: torch.Tensor,
                         device: torch.device) -> tuple[list[torch.Tensor], dict]:
    """Run the embedding part of `base_model` (e.g. LlamaModel) on each row of input_ids [n, seq].

    Returns one [1, seq, hidden] fp32 tensor per sample and the layer kwargs of the last call
    (all samples share seqlen, so RoPE and mask are the same for each).
    """
    inputs: list[torch.Tensor] = []
    layer_kwargs: dict = {}

    def pre_hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        inputs.append(hidden.detach().float())
        layer_kwargs.clear()
        layer_kwargs.update({k: v for k, v in kwargs.items() if k != "hidden_states"})
        raise _Captured

    handle = first_layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for row in input_ids:
                try:
                    base_model(input_ids=row.unsqueeze(0).to(device), use_cache=False)
                except _Captured:
                    pass
    finally:
        handle.remove()
    layer_kwargs["use_cache"] = False
    layer_kwargs.pop("cache", None)
    layer_kwargs.pop("past_key_values", None)
    return inputs, layer_kwargs


def batch_samples(xs: list[torch.Tensor], max_tokens: int = BATCH_TOKENS) -> list[torch.Tensor]:
    """Consecutive samples [1, seq, hidden] concatenated along dim 0 into batches of at most
    `max_tokens` tokens (at least one sample each): one call of a layer per batch instead of per
    sample. Samples share seqlen, so the captured RoPE and mask broadcast over the batch."""
    batches, run = [], []
    for x in xs:
        if run and (len(run) + 1) * x.shape[1] > max_tokens:
            batches.append(torch.cat(run) if len(run) > 1 else run[0])
            run = []
        run.append(x)
    if run:
        batches.append(torch.cat(run) if len(run) > 1 else run[0])
    return batches
