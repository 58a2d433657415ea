"""Check a packed checkpoint: the structure of every packed linear, then its outputs on real inputs.

1. Structure, read straight from the shards (quantkit.check.structure): shapes against
   config.json's hidden, intermediate and head sizes; dtypes; scales finite and > 0; zero
   points in range (GPTQ v1's stored zero - 1 undone); g_idx consistent with the group size
   (a permutation of the groups, in order unless desc_act); bits, group_size and sym as the
   config says.
2. The checkpoint is loaded and run on a few calibration-like windows of text. A hook on each
   QuantLinear takes the activations it really receives (x: [rows, K], the model dtype) and its
   output, and compares them with x @ W.T, W dequantized by `independent_dequantize` (code of
   its own, not quantkit.format.packing):
   - the model path: what the layer computed (the dense torch path on CPU, the kernel on CUDA);
   - the Triton kernel: all rows (and one row, the decode path) on CUDA; in Triton's
     interpreter on CPU, on a sample of rows and one block of output columns (it is slow);
   both must agree to float tolerance (`KERNEL_TOLERANCE`, relative to the largest magnitude).
3. With `original`, the relative error ||y_q - y_f||_F / ||y_f||_F against the original float
   linear on the same input, which must stay under `max_rel_error`. AWQ checkpoints fold
   per-channel scales into the weights; the plan saved beside them (awq_plan.safetensors) says
   which, and the comparison undoes those folds.

`CheckReport.passed` says whether every layer passed every check that ran. A layer whose inputs hold NaN
or inf (sent by a failing layer before it) is not checkable: it is reported apart, neither passed nor failed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quantkit.check.structure import LinearTensors, expected_shapes, independent_dequantize, structure_problems
from quantkit.devices import resolve_device
from quantkit.errors import QuantkitError
from quantkit.check.compare import awq_fold_scales, original_output, relative_max_diff, relative_output_error
from quantkit.format.awq_plan import PLAN_FILE, load_plan

KERNEL_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DEFAULT_MAX_REL_ERROR = 0.3  # INT4 g128 layers sit around 0.02-0.15; a corrupted tensor gives ~1 or more
INTERPRETER_ROWS = 2  # rows of x through the Triton interpreter on CPU
INTERPRETER_COLS = 128  # output columns (one interpreter tile) through the Triton interpreter on CPU


@dataclass
class LayerCheck:
    """The result for one packed linear (extend with fields; `problems` and `not_checkable` decide `passed`)."""

    name: str
    out_features: int
    in_features: int
    rows: int = 0  # input rows compared on the model path
    structure: list[str] = field(default_factory=list)  # structure problems ([]: sound)
    model_diff: float | None = None  # max |model path - independent| / max |independent|; None: not run
    kernel_diff: float | None = None  # the same for the Triton kernel; None: kernel not run
    kernel_rows: int = 0
    kernel_cols: int = 0
    rel_error: float | None = None  # vs the original float linear; None without an original
    problems: list[str] = field(default_factory=list)
    not_checkable: str | None = None  # why its outputs could not be compared (its inputs were not finite)

    @property
    def passed(self) -> bool:
        return not self.problems and self.not_checkable is None


@dataclass
class CheckReport:
    path: str
    original: str | None
    backend: str  # the backend whose kernel was compared ("triton" or "torch")
    kernel_checked: bool  # whether the Triton kernel ran
    layout: str
    bits: int
    group_size: int
    dtype: str
    device: str
    max_rel_error: float
    layers: list[LayerCheck]
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.layers) and all(layer.passed for layer in self.layers)

    @property
    def failures(self) -> list[LayerCheck]:
        """The layers whose own tensors or outputs are wrong."""
        return [layer for layer in self.layers if layer.problems]

    @property
    def not_checkable(self) -> list[LayerCheck]:
        """The layers that could not be judged: NaN or inf reached their inputs (from a failing layer before them,
        whose own problems are in `failures`)."""
        return [layer for layer in self.layers if layer.not_checkable is not None]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["passed"] = self.passed
        for entry, layer in zip(out["layers"], self.layers):
            entry["passed"] = layer.passed
        return out


# --- orchestration --------------------------------------------------------------------------------

@dataclass
class _Setup:
    """Everything a layer hook needs, resolved once."""

    kernel_checked: bool
    compiled: bool  # the kernel runs compiled (CUDA): all rows; else in the interpreter, a sample
    max_rel_error: float
    max_rows: int
    spec: object
    original: object | None  # ShardReader of the original checkpoint
    plan: dict[str, torch.Tensor] | None
    heads: tuple[int, int] | None = None  # (attention heads, KV heads)
    awq_groups: tuple = ()  # the layers' AWQ groups (ArchSpec.awq_groups), experts included


def resolve_backend(backend: str, device: torch.device) -> tuple[str, bool]:
    """(backend whose kernel is compared, whether it is the Triton kernel)."""
    from quantkit.kernels import BACKENDS
    from quantkit.kernels.triton_w4a16 import triton_available

    if backend not in BACKENDS:
        raise QuantkitError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "triton" if triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise QuantkitError("--backend triton needs triton: pip install triton")
    return backend, backend == "triton"


def check_structure(reader, config: dict, info, spec) -> dict[str, LayerCheck]:
    """A LayerCheck per packed linear of the shards, holding its structure problems. Each linear is
    checked against its own scheme (GPTQModel `dynamic` rules, compressed-tensors config groups)."""
    from quantkit.model.quant_format import packed_prefixes

    shapes = expected_shapes(config)
    results = {}
    for name in sorted(packed_prefixes(reader.keys()), key=lambda n: _model_order(n, spec)):
        scheme = info.scheme_for(name)
        t, layout, problems = _stored_tensors(reader, name, info, scheme)
        linear = name[len(spec.layers) + 1:].partition(".")[2] if name.startswith(spec.layers + ".") else name
        if not problems:
            problems = structure_problems(t, shapes.get(linear), layout=layout, bits=scheme.bits,
                                          group_size=scheme.group_size, sym=scheme.sym, desc_act=info.desc_act)
        n = t.scales.shape[-1] if t is not None else 0
        k = t.qweight.numel() * (32 // scheme.bits) // max(n, 1) if t is not None else 0
        results[name] = LayerCheck(name, n, k, structure=problems, problems=list(problems))
    return results


def _stored_tensors(reader, name: str, info, scheme) -> tuple[LinearTensors | None, str, list[str]]:
    """(tensors, their layout, problems) of one packed linear. compressed-tensors pack-quantized is
    first repacked into gptq_v2, as every quantkit reader does (a shape it cannot repack is a problem)."""
    from quantkit.format import compressed_tensors as ct

    def get(suffix):
        return reader.get(f"{name}.{suffix}") if f"{name}.{suffix}" in reader else None

    if info.layout != ct.FORMAT:
        return LinearTensors(get("qweight"), get("qzeros"), get("scales"), get("g_idx")), info.layout, []
    try:
        tensors = {s: t for s in ct.TENSOR_SUFFIXES if (t := get(s)) is not None}
        p = ct.ct_to_packed(tensors, scheme.bits, scheme.group_size, scheme.sym)
    except (ValueError, KeyError) as exc:
        return None, "gptq_v2", [f"compressed-tensors tensors disagree with the config: {exc}"]
    return LinearTensors(p.qweight, p.qzeros, p.scales, p.g_idx), "gptq_v2", []


def _model_order(name: str, spec) -> tuple:
    """Sort key putting linears in the order the model runs them: layer index, then spec order."""
    index, _, linear = name[len(spec.layers) + 1:].partition(".")
    if not name.startswith(spec.layers + ".") or not index.isdigit():
        return (1, 0, (0, 0), name)
    return (0, int(index), spec.order_of(linear), name)


def evenly_spaced(x: torch.Tensor, count: int) -> torch.Tensor:
    """At most `count` rows of x, evenly spaced (every window and position represented)."""
    return x if x.shape[0] <= count else x[torch.linspace(0, x.shape[0] - 1, count).long()]


def check_layer(check: LayerCheck, module, x: torch.Tensor, y: torch.Tensor, setup: _Setup) -> None:
    """Compare one packed linear's output y on its input x with the independent dequantization."""
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    picked = torch.linspace(0, x.shape[0] - 1, min(setup.max_rows, x.shape[0])).long()
    x, y = x[picked], y[picked]
    check.rows = int(x.shape[0])
    if not torch.isfinite(x).all():  # what a layer before it sent: nothing to compare this one's outputs with
        check.not_checkable = "NaN or inf in its inputs (from a layer before it)"
        return
    t = LinearTensors(module.qweight.cpu(), module.qzeros.cpu(), module.scales.cpu(),
                      None if module.g_idx is None else module.g_idx.cpu())
    w = independent_dequantize(t, layout=module.layout, bits=module.bits, group_size=module.group_size)
    ref32 = x.float() @ w.to(x.device).T  # [T, N] fp32
    if module.bias is not None:
        ref32 = ref32 + module.bias.float()
    tolerance = KERNEL_TOLERANCE[x.dtype]
    if not torch.isfinite(ref32).all():
        check.problems.append("independent dequantization gives non-finite outputs (corrupted scales or inputs)")
    check.model_diff = relative_max_diff(y, ref32.to(y.dtype))
    if not check.model_diff <= tolerance:
        check.problems.append(f"model path disagrees with the independent dequantization "
                              f"({check.model_diff:.2e} > {tolerance:.0e})")
    if setup.kernel_checked and module.bits == 4:
        check.kernel_diff = _kernel_diff(check, module, x, ref32, setup)
        if not check.kernel_diff <= tolerance:
            check.problems.append(f"kernel disagrees with the independent dequantization "
                                  f"({check.kernel_diff:.2e} > {tolerance:.0e})")
    if setup.original is not None:
        check.rel_error = _error_vs_original(check.name, x, ref32, setup)
        if not check.rel_error <= setup.max_rel_error:
            check.problems.append(f"error vs the original {check.rel_error:.3f} > {setup.max_rel_error}")


def _kernel_diff(check: LayerCheck, module, x: torch.Tensor, ref32: torch.Tensor, setup: _Setup) -> float:
    """The Triton kernel against ref32: compiled, every row and one row (the decode path); in the
    interpreter, INTERPRETER_ROWS rows by one block of INTERPRETER_COLS output columns."""
    from quantkit.kernels import w4a16_matmul

    qweight, qzeros, scales, bias = module.qweight, module.qzeros, module.scales, module.bias
    n = module.out_features
    cols = slice(0, n)
    if not setup.compiled and n > INTERPRETER_COLS:
        start = (n - INTERPRETER_COLS) // 2 // 8 * 8  # the middle block, whole packed words
        cols = slice(start, start + INTERPRETER_COLS)
        words = slice(start // 8, (start + INTERPRETER_COLS) // 8)
        qweight = qweight[:, words] if module.layout == "awq" else qweight[:, cols]
        qzeros, scales = qzeros[:, words], scales[:, cols]
        bias = None if bias is None else bias[cols]
    if not setup.compiled:
        x = evenly_spaced(x, INTERPRETER_ROWS)
        ref32 = evenly_spaced(ref32, INTERPRETER_ROWS)
    kw = dict(layout=module.layout, group_size=module.group_size, g_idx=module.g_idx, bias=bias, backend="triton")
    ref = ref32[:, cols].to(x.dtype)
    diff = relative_max_diff(w4a16_matmul(x, qweight, qzeros, scales, **kw), ref)
    if setup.compiled:
        diff = max(diff, relative_max_diff(w4a16_matmul(x[:1], qweight, qzeros, scales, **kw), ref[:1]))
    check.kernel_rows, check.kernel_cols = int(x.shape[0]), cols.stop - cols.start
    return diff


def _error_vs_original(name: str, x: torch.Tensor, y_q: torch.Tensor, setup: _Setup) -> float:
    reader = setup.original
    weight = reader.get(f"{name}.weight").to(x.device)
    if tuple(weight.shape) != (y_q.shape[1], x.shape[1]):
        raise QuantkitError(f"{name}: the original weight is {tuple(weight.shape)}, the checkpoint packs "
                            f"{(y_q.shape[1], x.shape[1])}; is --original the model this was quantized from?")
    bias = reader.get(f"{name}.bias").to(x.device) if f"{name}.bias" in reader else None
    col = row = None
    if setup.plan:
        index, _, linear = name[len(setup.spec.layers) + 1:].partition(".")
        col, row = awq_fold_scales(setup.spec, setup.plan, int(index), linear, setup.heads, setup.awq_groups)
        col = None if col is None else col.to(x.device)
        row = None if row is None else row.to(x.device)
    return relative_output_error(y_q, original_output(x, weight, bias, col, row))


def check_checkpoint(qdir: str | Path, original: str | Path | None = None, backend: str = "auto",
                     max_rel_error: float = DEFAULT_MAX_REL_ERROR, *, calib: str | None = None,
                     nsamples: int = 4, seqlen: int = 128, max_rows: int = 256, seed: int = 0,
                     device: str = "auto", show_progress: bool = True) -> CheckReport:
    """Check the structure of every packed linear of `qdir`, then run it on calibration-like inputs.

    calib: a .txt/.jsonl file, folder or recipe (as `quantkit quantize --calib`); None uses the
    project's synthetic stories. At most `max_rows` rows of each layer's input are compared.
    """
    from quantkit.format.arch import head_counts
    from quantkit.model.source import open_model

    source = open_model(qdir)
    path, config, info = source.path, source.config, source.quant
    dev = resolve_device(device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    ran, kernel_checked = resolve_backend(backend, dev)
    if info is None:
        raise QuantkitError(f"{path}: not a quantized checkpoint (config.json has no quantization_config)")
    spec = source.spec
    checks = check_structure(source.reader, config, info, spec)
    if not checks:
        raise QuantkitError(f"{path}: no packed linears found")
    notes = _backend_notes(ran, kernel_checked, dev)
    setup = _Setup(kernel_checked, dev.type == "cuda", max_rel_error, max_rows, spec, None, None, head_counts(config),
                   spec.awq_groups(config))
    if original is not None:
        setup.original = open_model(original).reader
        setup.plan = _awq_plan(path, info, notes)
        if setup.plan is None and info.layout == "awq":
            setup.original = None
    sound = {name for name, c in checks.items() if not c.structure}
    if len(sound) < len(checks):
        notes.append(f"{len(checks) - len(sound)} layers failed the structure check: their outputs were not compared")
    if sound:
        _run_inputs(source, checks, sound, setup, dtype, dev, "torch" if ran == "torch" else "auto",
                    (calib, nsamples, seqlen, seed), notes, show_progress)
    unchecked = sum(c.not_checkable is not None for c in checks.values())
    if unchecked:
        notes.append(f"{unchecked} layers were not checkable: NaN or inf reached their inputs, from the failing "
                     f"layers before them; mend those first")
    if kernel_checked and any(c.kernel_diff is None and c.model_diff is not None for c in checks.values()):
        notes.append("layers that are not 4-bit have no W4A16 kernel: the model path and the error against "
                     "the original are checked")
    return CheckReport(str(path), None if original is None else str(original), ran, kernel_checked, info.layout,
                       info.bits, info.group_size, str(dtype).removeprefix("torch."), str(dev), max_rel_error,
                       list(checks.values()), notes)


def _backend_notes(ran: str, kernel_checked: bool, dev: torch.device) -> list[str]:
    from quantkit.kernels.triton_w4a16 import triton_available

    if kernel_checked and dev.type != "cuda":
        return [f"the Triton kernel ran in its interpreter (no GPU) on {INTERPRETER_ROWS} rows x "
                f"{INTERPRETER_COLS} output columns of each layer"]
    if not kernel_checked:
        why = "--backend torch" if triton_available() else "triton is not installed"
        return [f"the Triton kernel was not run ({why}): the model's {ran} path was compared with an "
                f"independent dequantization"]
    return []


def _run_inputs(source: "ModelSource", checks: dict[str, LayerCheck], names: set[str], setup: _Setup, dtype: torch.dtype,
                dev: torch.device, model_backend: str, inputs: tuple, notes: list[str], show_progress: bool) -> None:
    """Load the checkpoint and compare every layer in `names` on its real inputs (hooks)."""
    from quantkit.check.inputs import calibration_ids
    from quantkit.model.loader import load_model
    from quantkit.model.quant_linear import QuantLinear
    from quantkit.progress import progress_bar

    # non-finite scales loaded all the same: the structure check has reported them, and the others are run
    model, _ = load_model(source, dtype=dtype, device=str(dev), backend=model_backend, finite_scales=False)
    ids = calibration_ids(source, *inputs, notes)
    hooked = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear) and n in names]
    with progress_bar("check layers", len(hooked), show_progress) as advance:
        def hook(name):
            def run(module, args, output):
                check_layer(checks[name], module, args[0].detach(), output.detach(), setup)
                advance()
            return run

        handles = [m.register_forward_hook(hook(n)) for n, m in hooked]
        blocks = _moe_block_inputs(model, handles)
        try:
            with torch.no_grad():
                model(ids.to(dev))
                unreached = _run_unreached_experts(blocks, checks, names)
        finally:
            for h in handles:
                h.remove()
    if unreached:
        notes.append(f"{unreached} experts got no token of the check's inputs from the router: they were run on "
                     f"every token of their layer's MoE block instead")


def _moe_block_inputs(model, handles: list) -> list[tuple[str, object, list]]:
    """(name, block, [its input]) of each MoE block (quantkit.model.moe.SparseMoeBlock), the input recorded on the
    forward by a pre-hook whose handle joins `handles`."""
    from quantkit.model.moe import SparseMoeBlock

    blocks = []
    for name, m in model.named_modules():
        if isinstance(m, SparseMoeBlock):
            seen: list = []
            handles.append(m.register_forward_pre_hook(lambda _m, args, seen=seen: seen.append(args[0])))
            blocks.append((name, m, seen))
    return blocks


def _run_unreached_experts(blocks, checks: dict[str, LayerCheck], names: set[str]) -> int:
    """Run each expert none of whose packed linears got a row (the router sent it no token) on every token its
    block saw, so that its linears are compared too; returns how many experts that was."""
    count = 0
    for name, block, seen in blocks:
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen])
        for e, expert in enumerate(block.expert_list):
            linears = [f"{name}.{block.spec.experts}.{e}.{leaf}" for leaf in expert.names]
            if any(n in names for n in linears) and all(checks[n].rows == 0 for n in linears if n in names):
                expert(x)
                count += 1
    return count


def _awq_plan(path: Path, info, notes: list[str]) -> dict[str, torch.Tensor] | None:
    """The AWQ plan saved with the checkpoint, whatever its layout ({} when there is none and the layout
    is not AWQ's: nothing folded)."""
    file = path / PLAN_FILE
    if not file.is_file() and info.layout != "awq":
        return {}
    if not file.is_file():
        notes.append(f"AWQ checkpoint without {PLAN_FILE}: the scales folded into its weights are unknown, "
                     f"so errors against the original are not reported")
        return None
    return load_plan(file)
