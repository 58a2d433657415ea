"""What AWQ sees of a decoder layer: each LinearGroup's input and each inspected module's calls,
captured with forward pre-hooks on one run of the layer; and those calls merged into batches.

Inspected modules are called again with exactly the arguments the layer gave them (RoPE, masks,
hidden states), so no knowledge of their signatures is needed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantkit.format.arch import LinearGroup, get_submodule
from quantkit.quant.capture import batch_samples
from quantkit.quant.methods import LayerContext

MERGE_TOKENS = 4096  # tokens per merged call of an inspected module during the scale search


@dataclass
class Capture:
    """What one run of the float layer shows: its outputs, each group's input, each inspected call."""

    outputs: list[torch.Tensor]  # per batch of samples, [batch, seq, hidden]
    inputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # group -> per batch [batch, seq, K]
    calls: dict[str, list[tuple[tuple, dict]]] = field(default_factory=dict)  # inspect path -> (args, kwargs)


def capture(ctx: LayerContext, groups: list[LinearGroup], inspect: bool, keep=None,
            inputs: list[torch.Tensor] | None = None, run=None) -> Capture:
    """Run the layer once with pre-hooks on each group's first linear (and inspected modules).

    `keep` maps each captured group input before it is stored (the clip search keeps a strided
    sample of tokens, so the whole activation set is never held for every group at once). `run(inputs)`: how the
    layer runs and what becomes `outputs` (default ctx.run_layer)."""
    cap = Capture(outputs=[])
    hooks = []
    keep = keep or (lambda x: x)
    for g in groups:
        store = cap.inputs.setdefault(g.name, [])
        hooks.append(get_submodule(ctx.layer, g.linears[0]).register_forward_pre_hook(
            lambda _m, args, kwargs, store=store: store.append(keep(args[0] if args else kwargs["input"])),
            with_kwargs=True))
        if inspect and g.inspect not in cap.calls:
            calls = cap.calls.setdefault(g.inspect, [])
            hooks.append(get_submodule(ctx.layer, g.inspect).register_forward_pre_hook(
                lambda _m, args, kwargs, calls=calls: calls.append(_fp32_call(args, kwargs)), with_kwargs=True))
    try:
        cap.outputs = (run or ctx.run_layer)(inputs)
    finally:
        for h in hooks:
            h.remove()
    return cap


def _fp32_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments with floating tensors in fp32: the search re-runs the module in fp32 even
    when the capture ran under bf16 autocast. fp32 tensors stay the same objects (merge_calls
    relies on shared ones, e.g. RoPE, being identical)."""
    def fp32(v):
        return v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    return tuple(fp32(a) for a in args), {k: fp32(v) for k, v in kwargs.items()}


def merge_calls(calls: list[tuple[tuple, dict]], max_tokens: int = MERGE_TOKENS) -> list[tuple[tuple, dict]]:
    """Fewer, larger calls of the same module: consecutive calls whose arguments are either the
    same objects (RoPE, a shared mask) or tensors that differ only along dim 0 (the samples' hidden
    states, [1, seq, K]) become one call on their concatenation, up to `max_tokens` rows of
    tokens. Calls that cannot be merged stay as they are. The outputs concatenate the same way."""
    merged, run = [], []
    for call in calls:
        if run and (_tokens(run) + _tokens([call]) > max_tokens or not _mergeable(run[0], call)):
            merged.append(_concat(run))
            run = []
        run.append(call)
    if run:
        merged.append(_concat(run))
    return merged


def _tokens(calls) -> int:
    return sum(t.shape[:-1].numel() for a, kw in calls for t in (*a, *kw.values())
               if isinstance(t, torch.Tensor) and t.dim() == 3) or 1


def _varying(a, b) -> bool:
    """True when a and b are tensors that can be stacked along dim 0; False when they are the same object."""
    if a is b:
        return False
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape[1:] == b.shape[1:]:
        return True
    raise _NotMergeable


class _NotMergeable(Exception):
    pass


def _mergeable(first, call) -> bool:
    (a1, k1), (a2, k2) = first, call
    if len(a1) != len(a2) or k1.keys() != k2.keys():
        return False
    try:
        for x, y in [*zip(a1, a2), *((k1[k], k2[k]) for k in k1)]:
            _varying(x, y)
    except _NotMergeable:
        return False
    return True


def _concat(run):
    if len(run) == 1:
        return run[0]
    args0, kw0 = run[0]
    args = tuple(torch.cat([a[i] for a, _ in run]) if any(a[i] is not args0[i] for a, _ in run) else args0[i]
                 for i in range(len(args0)))
    kwargs = {k: torch.cat([kw[k] for _, kw in run]) if any(kw[k] is not kw0[k] for _, kw in run) else kw0[k]
              for k in kw0}
    return args, kwargs


def strided_samples(batches: list[torch.Tensor], max_tokens: int) -> list[torch.Tensor]:
    """Every k-th calibration sample of `batches` ([batch, seq, hidden] each), k chosen so that at
    most `max_tokens` tokens remain (all of them for max_tokens <= 0), re-batched as the pipeline
    batches them."""
    samples = [x[i : i + 1] for x in batches for i in range(x.shape[0])]
    tokens = sum(x.shape[1] for x in samples)
    if max_tokens <= 0 or tokens <= max_tokens:
        return batches
    step = -(-tokens // max_tokens)
    return batch_samples(samples[::step])
