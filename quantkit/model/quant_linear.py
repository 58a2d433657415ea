"""QuantLinear: a linear layer whose weight is a packed INT4/INT8 checkpoint tensor set."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.format.packing import PackedLinear, dequantize


class QuantLinear(nn.Module):
    """Holds qweight/qzeros/scales(/g_idx, bias) as buffers under the names the checkpoint uses.

    On CUDA the forward runs the W4A16 kernel on the packed weights. On CPU the weight stays
    quantized: 4-bit weights are repacked once for quantkit's kernels (`quantkit.kernels.int4_cpu`,
    any shape and group size); where that kernel does not build, into torch's CPU int4 layout (or
    int8, per channel), run by torch's kernels for small M and dequantized per call for large M
    (`quantkit.kernels.cpu_int`). Weights none of these take (grouped 8-bit, other bit widths, odd
    shapes) fall back to a dense copy in the activation dtype; `cpu_path` says which path runs and why.

    `repack_for_cpu` repacks eagerly and drops the checkpoint tensors (the engine's load); without
    it the first CPU forward repacks and keeps them (the checker reads them).
    """

    def __init__(self, packed: PackedLinear, backend: str = "auto", in_features: int | None = None,
                 out_features: int | None = None):
        super().__init__()
        self.layout = packed.layout
        self.bits = packed.bits
        self.group_size = packed.group_size
        self.in_features = packed.in_features if in_features is None else in_features
        self.out_features = packed.out_features if out_features is None else out_features
        self.backend = backend
        self.register_buffer("qweight", packed.qweight)
        self.register_buffer("qzeros", packed.qzeros)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("g_idx", packed.g_idx)
        self.register_buffer("bias", packed.bias)
        self._cpu = None  # Int4Weight | Int8Weight | dense torch.Tensor [N, K], once repacked
        self._direct = None  # int4_cpu.DirectCall: activations of its dtype straight to the kernel
        self.prompt_q8 = None  # int4_cpu.DirectCall of the W4A8 kernel for the step's prompt rows (int8_prefill)
        self.cpu_path = "not repacked"

    @classmethod
    def concat(cls, parts: list[QuantLinear]) -> QuantLinear | None:
        """One CPU linear computing `parts` (same input) side by side, output [..., sum N_i] (q/k/v or
        gate/up in one kernel call); None unless all run quantkit's int4 kernel on layouts that concatenate
        (int4_cpu.concat_blocked). Checkpoint tensors are not kept: call after repack_for_cpu."""
        from quantkit.kernels.int4_cpu import Int4Blocked, concat_blocked

        first = parts[0]
        if not all(isinstance(p._cpu, Int4Blocked) for p in parts) or len({p.bias is None for p in parts}) != 1:
            return None
        w = concat_blocked([p._cpu for p in parts])
        if w is None:
            return None
        fused = cls(PackedLinear(first.layout, first.bits, first.group_size, None, None, None, None,
                                 None if first.bias is None else torch.cat([p.bias for p in parts])),
                    backend=first.backend, in_features=first.in_features, out_features=w.out_features)
        fused._cpu, fused.cpu_path = w, first.cpu_path
        d = first._direct  # the parts share a group size and no act-order: the same kernel and crossover
        fused._direct = d.on(w) if d is not None else None
        if all(p.prompt_q8 is not None for p in parts):
            fused.prompt_q8 = first.prompt_q8.on(w)
        return fused

    def point_at(self, w) -> None:
        """Read the int4 weight from `w` (an Int4Blocked of the same layout, e.g. a view into stacked experts) from now
        on, with the same kernel and crossover."""
        self._cpu = w
        if self._direct is not None:
            self._direct = self._direct.on(w)
        if self.prompt_q8 is not None:
            self.prompt_q8 = self.prompt_q8.on(w)

    def int4_kernel(self):
        """(Int4Blocked, DirectCall | None) where this linear runs quantkit's int4 kernel (after repack_for_cpu), else
        None: what a grouped call over several linears (an MoE layer's experts) reads."""
        from quantkit.kernels.int4_cpu import Int4Blocked

        return (self._cpu, self._direct) if isinstance(self._cpu, Int4Blocked) else None

    def packed(self) -> PackedLinear:
        return PackedLinear(self.layout, self.bits, self.group_size, self.qweight, self.qzeros, self.scales,
                            self.g_idx, self.bias)

    def repack_for_cpu(self, dtype: torch.dtype, drop_checkpoint_tensors: bool = True,
                       int8_activations: bool = False, int8_prefill: bool = False, by_default: bool = False) -> str:
        """Repack for the CPU kernels (activations in `dtype`); returns `cpu_path`. `int8_activations`: batches
        below the dense crossover run the W4A8 kernel (x rounded to int8 per row and group) where it builds and
        takes the weight. `int8_prefill`: only the prompt rows of a step do (quantkit.model.prompt_rows),
        where that kernel takes the weight (`prompt_q8`); the rest stay on the path chosen here. `by_default`: the
        engine's default rather than asked, so not where it would take the prompt rows off AMX tiles
        (linear_choice.prompt_split_default)."""
        from dataclasses import replace

        from quantkit.kernels import int4_cpu
        from quantkit.kernels.cpu_int import int4_unsupported, repack_int4, repack_int8
        from quantkit.kernels.linear_choice import LinearCase, choose, prompt_split_default

        p = self.packed()
        reason = int4_unsupported(p)
        ours_missing = int4_cpu.unavailable() if p.bits == 4 else "not 4-bit"
        w = int4_cpu.repack(p) if ours_missing is None else None
        case = LinearCase(p.bits, w.group_size if w is not None else p.group_size, dtype, p.bias is not None,
                          w is not None and w.perm is not None, int8_activations, reason)
        choice = choose(case)  # kernels/linear_choice.py's table: the first row that runs this linear
        layout = choice.kernel.layout
        if layout == "int4 blocks":
            self._cpu, self.cpu_path = w, choice.cpu_path
            self._direct = int4_cpu.direct_call(w, choice.direct, choice.dense_from_m, dtype) if choice.direct else None
            own = choice.direct is not None and choice.direct != "q8"  # W4A16 straight to the kernel
            q8 = choose(replace(case, int8_activations=True)) if int8_prefill and own else None
            if q8 is not None and by_default and not prompt_split_default(choice, q8):
                q8 = None
            self.prompt_q8 = int4_cpu.direct_call(w, "q8", q8.dense_from_m, dtype) if q8 and q8.direct == "q8" \
                else None
        elif layout == "torch int4pack":
            self._cpu, self.cpu_path = repack_int4(p, dtype), f"int4 (torch int4pack; quantkit kernel: {ours_missing})"
        elif layout == "int8":
            try:
                self._cpu, self.cpu_path = repack_int8(p, dtype), "int8"
            except ValueError as e:
                self._cpu, self.cpu_path = dequantize(p, dtype), f"dense ({e})"
        else:
            self._cpu, self.cpu_path = dequantize(p, dtype), f"dense ({reason})"
        if drop_checkpoint_tensors:
            for name in ("qweight", "qzeros", "scales", "g_idx"):
                setattr(self, name, None)
        return self.cpu_path

    def weight_bytes(self) -> int:
        """Bytes of the weight as the forward reads it (CPU repacked form, else the checkpoint tensors)."""
        tensors = [t for t in (self.qweight, self.qzeros, self.scales, self.g_idx, self.bias) if t is not None]
        if self._cpu is not None:
            tensors += [self._cpu] if isinstance(self._cpu, torch.Tensor) else [
                t for t in vars(self._cpu).values() if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        direct = self._direct
        if direct is not None and x.dtype == direct.dtype and not x.is_cuda:
            flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            out = self._prompt_split(flat) if self.prompt_q8 is not None else None
            if out is None and flat.shape[0] < direct.max_m:  # decode-sized: straight to the kernel
                out = direct(flat)  # (which makes x contiguous)
            if out is not None:
                return out if flat is x else out.view(*x.shape[:-1], self.out_features)
        if x.is_cuda and self.backend != "torch" and self.bits == 4:
            from quantkit.kernels import w4a16_matmul

            shape = x.shape
            out = w4a16_matmul(x.reshape(-1, shape[-1]), self.qweight, self.qzeros, self.scales,
                               layout=self.layout, group_size=self.group_size, g_idx=self.g_idx,
                               bias=self.bias, backend=self.backend)
            return out.reshape(*shape[:-1], self.out_features)
        return self._cpu_forward(x)

    def _prompt_split(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The step's prompt rows through the W4A8 kernel (below its crossover), the other rows as without it; None
        where the current forward names no prompt rows or `flat` is not the step's rows."""
        from quantkit.model.prompt_rows import current

        rows, q8 = current(), self.prompt_q8
        if rows is None or rows.total != flat.shape[0]:
            return None
        if rows.every:
            return q8(flat) if flat.shape[0] < q8.max_m else None
        out = flat.new_empty(flat.shape[0], self.out_features)
        prompt = flat.index_select(0, rows.prompt)
        out[rows.prompt] = q8(prompt) if prompt.shape[0] < q8.max_m else self._own_rows(prompt)
        out[rows.others] = self._own_rows(flat.index_select(0, rows.others))
        return out

    def _own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [M, K] on the W4A16 path chosen at repack (the direct call below its crossover, else dense tiles)."""
        return self._direct(x) if x.shape[0] < self._direct.max_m else self._cpu_forward(x)

    def _cpu_forward(self, x: torch.Tensor) -> torch.Tensor:
        from quantkit.kernels.cpu_int import Int4Weight, int4_kernel_max_m, int4_linear, int8_linear
        from quantkit.kernels.int4_cpu import Int4Blocked, int4_blocked_linear

        if self._cpu is None:
            self.repack_for_cpu(x.dtype, drop_checkpoint_tensors=False)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        bias = None if self.bias is None else self.bias.to(x.dtype)
        w = self._cpu
        if isinstance(w, Int4Blocked):
            out = int4_blocked_linear(x2, w, bias)
        elif isinstance(w, Int4Weight):
            max_m = int4_kernel_max_m(self.out_features, self.in_features, w.group_size, x.dtype)
            out = int4_linear(x2, w, bias, max_m)
        elif isinstance(w, torch.Tensor):
            out = nn.functional.linear(x2, w if w.dtype == x.dtype else w.to(x.dtype), bias)
        else:
            out = int8_linear(x2, w, bias)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, layout={self.layout}, cpu_path={self.cpu_path}")
