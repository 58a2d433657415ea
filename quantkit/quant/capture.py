"""Capturing what the decoder layers see: layer 0's hidden states per calibration sample and the
keyword arguments (RoPE cos/sin, mask, positions) the model passes to each layer."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from quantkit.format.arch import get_submodule


BATCH_TOKENS = 4096  # tokens per call of a decoder layer: samples are run together up to this many


class _Captured(Exception):
    """Raised by the last layer's stand-in to stop the forward pass (the real layers are not loaded)."""


class _Recorder(nn.Module):
    """Stands in for decoder layer `index` during the capture: records what the model passes it (hidden
    states at layer 0, keyword arguments at every layer) and hands the hidden states on unchanged."""

    def __init__(self, index: int, inputs: list, layer_kwargs: list[dict], last: bool):
        super().__init__()
        self.index, self.inputs, self.layer_kwargs, self.last = index, inputs, layer_kwargs, last

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        if self.index == 0:
            self.inputs.append(hidden.detach().float())
        self.layer_kwargs[self.index] = kwargs
        if self.last:
            raise _Captured
        return hidden


def capture_layer_inputs(base_model: nn.Module, layers: nn.ModuleList, input_ids: torch.Tensor,
                         device: torch.device, embed: Callable[[torch.Tensor], torch.Tensor] | None = None
                         ) -> tuple[list[torch.Tensor], list[dict]]:
    """Run the embedding part of `base_model` (e.g. LlamaModel) on each row of input_ids [n, seq]; with `embed`
    (ids [1, seq] -> [1, seq, hidden]) the model gets embed(row) as its inputs_embeds instead of the ids.

    Returns one [1, seq, hidden] fp32 tensor per sample (layer 0's input) and, per layer, the keyword
    arguments the model passes it on the last call: RoPE, mask, positions. All samples share seqlen, so
    these are the same for each; they differ between layers where the layers differ (Gemma 3's sliding
    and full attention layers get their own RoPE and mask). Each layer is replaced by a `_Recorder` for
    the run, so no layer computes.
    """
    inputs: list[torch.Tensor] = []
    layer_kwargs: list[dict] = [{} for _ in layers]
    real = list(layers)
    for i in range(len(real)):
        layers[i] = _Recorder(i, inputs, layer_kwargs, last=i == len(real) - 1)
    try:
        with torch.no_grad():
            for row in input_ids:
                ids = row.unsqueeze(0).to(device)
                fed = {"input_ids": ids} if embed is None else {"inputs_embeds": embed(ids)}
                try:
                    base_model(**fed, use_cache=False)
                except _Captured:
                    pass
    finally:
        for i, layer in enumerate(real):
            layers[i] = layer
    for kwargs in layer_kwargs:
        kwargs["use_cache"] = False
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
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


class _HaveInputs(Exception):
    """Raised by the last hooked linear to stop the layer's forward pass: what follows changes no statistic."""


def fold_linear_inputs(ctx, names: list[str], update: Callable[[object, torch.Tensor], object]) -> dict[str, object]:
    """A statistic of each linear's input over the calibration inputs of one decoder layer (a LayerContext, `ctx`),
    in one run of the layer: state = update(state, x) for every input x [..., K] (state None at first).

    Linears of one spec group read the same tensor: the first is hooked and its statistic shared. The run stops as
    soon as the last hooked linear has its input (the rest of the layer would not change the statistics)."""
    shared, hooked = _hooked_linears(ctx, names)
    state: dict[str, object] = {}

    def seen(name: str, x: torch.Tensor) -> None:
        state[name] = update(state.get(name), x)

    with _hooks(ctx.layer, hooked, seen):
        ctx.run_for_hooks(_HaveInputs)
    return {n: state[shared[n]] for n in names}


def fold_paired_linear_inputs(ctx, float_ctx, names: list[str],
                              update: Callable[[object, torch.Tensor, torch.Tensor], object]) -> dict[str, object]:
    """As fold_linear_inputs, over two runs a batch: `float_ctx` (the float layer on the float model's inputs) and
    `ctx` (the layer as it is, on the quantized model's), batch by batch; state = update(state, x_float, x_quant) for
    each pair of a linear's inputs on the same tokens (GPTAQ's statistics)."""
    shared, hooked = _hooked_linears(ctx, names)
    state: dict[str, object] = {}
    for x_float, x_quant in zip(float_ctx.inputs, ctx.inputs, strict=True):
        pair: dict[str, list[torch.Tensor]] = {n: [] for n in hooked}

        def seen(name: str, x: torch.Tensor) -> None:
            pair[name].append(x)

        for c, x in ((float_ctx, x_float), (ctx, x_quant)):
            with _hooks(c.layer, hooked, seen):
                c.run_for_hooks(_HaveInputs, [x])
        for name, (xf, xq) in pair.items():
            state[name] = update(state.get(name), xf, xq)
    return {n: state[shared[n]] for n in names}


def _hooked_linears(ctx, names: list[str]) -> tuple[dict[str, str], list[str]]:
    """(each of `names` -> the first linear of its spec group among `names`, whose input it shares; those first
    linears in the order the layer calls them)."""
    shared = {}
    for g in ctx.spec.groups:
        members = [n for n in g.linears if n in names]
        for n in members:
            shared[n] = members[0]
    return shared, [n for n in ctx.spec.linears if n in set(shared.values())]


@contextmanager
def _hooks(layer: nn.Module, hooked: list[str], seen: Callable[[str, torch.Tensor], None]):
    """Forward hooks on the linears `hooked` of `layer`: seen(name, input) for each call; the last raises _HaveInputs."""
    def hook_for(name: str, last: bool):
        def hook(_module, args, _output):
            seen(name, args[0])
            if last:
                raise _HaveInputs
        return hook

    handles = [get_submodule(layer, n).register_forward_hook(hook_for(n, n == hooked[-1])) for n in hooked]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
