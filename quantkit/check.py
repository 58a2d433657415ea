"""Check a packed checkpoint: every quantized linear through the W4A16 kernel.

The checkpoint is loaded and run on a few calibration-like windows of text. A hook on each
QuantLinear takes the activations the layer really receives (x: [rows, K], the model dtype)
and, there and then:
  1. runs the kernel (`backend`) at two batch sizes (one row: the decode path; all rows: the
     GEMM path) and compares it with the pure-torch reference dequant-matmul, which must agree
     to float tolerance (`KERNEL_TOLERANCE`, relative to the output's largest magnitude);
  2. with `original`, compares the reference output with the original float linear on the
     same input: relative error ||y_q - y_f||_F / ||y_f||_F, which must stay under
     `max_rel_error`. AWQ checkpoints fold per-channel scales into the weights; the plan saved
     beside them (awq_plan.safetensors) says which, and the comparison undoes those folds.

A kernel that disagrees with the reference, a non-finite output, or an error past the bound
fails the check; `CheckReport.passed` says whether every layer passed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quantkit.errors import QuantkitError

KERNEL_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DEFAULT_MAX_REL_ERROR = 0.3  # INT4 g128 layers sit around 0.02-0.15; a corrupted tensor gives ~1 or more
PLAN_FILE = "awq_plan.safetensors"


@dataclass
class LayerCheck:
    """The result for one packed linear."""

    name: str
    out_features: int
    in_features: int
    rows: int
    kernel_diff: float | None  # max |kernel - reference| / max |reference|; None: kernel not run
    rel_error: float | None  # vs the original float linear; None without an original
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


@dataclass
class CheckReport:
    path: str
    original: str | None
    backend: str  # the backend that ran ("triton" or "torch")
    kernel_checked: bool  # False when the backend was the reference itself
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
        return [layer for layer in self.layers if not layer.passed]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["passed"] = self.passed
        for entry, layer in zip(out["layers"], self.layers):
            entry["passed"] = layer.passed
        return out


# --- the comparisons (pure) ----------------------------------------------------------------------

def relative_max_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in fp32; inf when either holds NaN or inf."""
    out, ref = out.float(), ref.float()
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return float("inf")
    scale = ref.abs().max().clamp(min=torch.finfo(torch.float32).tiny)
    return float((out - ref).abs().max() / scale) if out.numel() else 0.0


def relative_output_error(y_q: torch.Tensor, y_f: torch.Tensor) -> float:
    """||y_q - y_f||_F / ||y_f||_F in fp32; inf when y_q is not finite."""
    y_q, y_f = y_q.float(), y_f.float()
    if not torch.isfinite(y_q).all():
        return float("inf")
    return float((y_q - y_f).norm() / y_f.norm().clamp(min=torch.finfo(torch.float32).tiny))


def original_output(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    col_scale: torch.Tensor | None, row_scale: torch.Tensor | None) -> torch.Tensor:
    """What the original linear gives, in the quantized layer's units.

    x [T, K] is the quantized model's input, which AWQ divided by col_scale [K]; the quantized
    linear's output rows were divided by row_scale [N] (it feeds a folded group). So the
    original sees x * col_scale, and its output is divided by row_scale to compare.
    """
    x = x.float()
    if col_scale is not None:
        x = x * col_scale.float()
    y = x @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    if row_scale is not None:
        y = y / row_scale.float()
    return y


def awq_fold_scales(spec, plan: dict[str, torch.Tensor], layer_index: int, linear: str
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(col_scale [K], row_scale [N]) folded into `linear` (relative to its decoder layer) by AWQ.

    col_scale: the scale of the group the linear belongs to; row_scale: the scale of the group
    this linear feeds (when the feeder is a linear, e.g. up_proj -> down_proj). None: not folded.
    """
    prefix = f"layers.{layer_index}."
    col = row = None
    for group in spec.groups:
        scale = plan.get(f"{prefix}{group.name}.scale")
        if scale is None:
            continue
        if linear in group.linears:
            col = scale
        if not group.feeder_is_norm and group.feeder == linear:
            row = scale
    return col, row


# --- orchestration --------------------------------------------------------------------------------

@dataclass
class _Setup:
    """Everything a layer hook needs, resolved once."""

    backend: str
    kernel_checked: bool
    layout: str
    bits: int
    group_size: int
    max_rel_error: float
    max_rows: int
    spec: object
    layers_path: str
    original: object | None  # ShardReader of the original checkpoint
    plan: dict[str, torch.Tensor] | None


def resolve_backend(backend: str, device: torch.device) -> tuple[str, bool]:
    """(backend that runs, whether it is a kernel distinct from the reference)."""
    from quantkit.kernels import BACKENDS
    from quantkit.kernels.triton_w4a16 import triton_available

    if backend not in BACKENDS:
        raise QuantkitError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise QuantkitError("--backend triton needs triton: pip install triton")
    return backend, backend == "triton"


def check_layer(name: str, module, x: torch.Tensor, setup: _Setup) -> LayerCheck:
    """Run one packed linear's checks on its input x [T, K]."""
    from quantkit.kernels import w4a16_matmul, w4a16_matmul_reference

    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] > setup.max_rows:  # evenly spaced rows: every window and position represented
        x = x[torch.linspace(0, x.shape[0] - 1, setup.max_rows).long()]
    tensors = (module.qweight, module.qzeros, module.scales)
    kw = dict(layout=module.layout, group_size=module.group_size, g_idx=module.g_idx, bias=module.bias)
    ref32 = w4a16_matmul_reference(x.float(), *tensors, bits=module.bits, **kw)  # [T, N] fp32
    check = LayerCheck(name, module.out_features, module.in_features, int(x.shape[0]), None, None)
    if not torch.isfinite(ref32).all():
        check.problems.append("reference output is not finite (corrupted scales or inputs)")
    if setup.kernel_checked and module.bits == 4:
        out = w4a16_matmul(x, *tensors, backend=setup.backend, **kw)
        one = w4a16_matmul(x[:1], *tensors, backend=setup.backend, **kw)
        ref = ref32.to(x.dtype)
        check.kernel_diff = max(relative_max_diff(out, ref), relative_max_diff(one, ref[:1]))
        if not check.kernel_diff <= KERNEL_TOLERANCE[x.dtype]:
            check.problems.append(f"kernel disagrees with the reference ({check.kernel_diff:.2e} > "
                                  f"{KERNEL_TOLERANCE[x.dtype]:.0e})")
    if setup.original is not None:
        check.rel_error = _error_vs_original(name, x, ref32, setup)
        if not check.rel_error <= setup.max_rel_error:
            check.problems.append(f"error vs the original {check.rel_error:.3f} > {setup.max_rel_error}")
    return check


def _error_vs_original(name: str, x: torch.Tensor, y_q: torch.Tensor, setup: _Setup) -> float:
    reader = setup.original
    weight = reader.get(f"{name}.weight").to(x.device)
    if tuple(weight.shape) != (y_q.shape[1], x.shape[1]):
        raise QuantkitError(f"{name}: the original weight is {tuple(weight.shape)}, the checkpoint packs "
                            f"{(y_q.shape[1], x.shape[1])}; is --original the model this was quantized from?")
    bias = reader.get(f"{name}.bias").to(x.device) if f"{name}.bias" in reader else None
    col = row = None
    if setup.plan:
        index, _, linear = name[len(setup.layers_path) + 1:].partition(".")
        col, row = awq_fold_scales(setup.spec, setup.plan, int(index), linear)
        col = None if col is None else col.to(x.device)
        row = None if row is None else row.to(x.device)
    return relative_output_error(y_q, original_output(x, weight, bias, col, row))


def check_checkpoint(qdir: str | Path, original: str | Path | None = None, backend: str = "auto",
                     max_rel_error: float = DEFAULT_MAX_REL_ERROR, *, calib: str | None = None,
                     nsamples: int = 4, seqlen: int = 128, max_rows: int = 256, seed: int = 0,
                     device: str = "auto", show_progress: bool = True) -> CheckReport:
    """Run every packed linear of `qdir` through the kernel on calibration-like inputs.

    calib: a .txt/.jsonl file, folder or recipe (as `quantkit quantize --calib`); None uses the
    project's synthetic stories. At most `max_rows` rows of each layer's input are checked.
    """
    from quantkit.model.checkpoint import ShardReader, read_config, resolve_model_path
    from quantkit.model.loader import load_model
    from quantkit.model.quant_linear import QuantLinear
    from quantkit.progress import progress_bar
    from quantkit.format.arch import spec_for

    path = resolve_model_path(str(qdir))
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    ran, kernel_checked = resolve_backend(backend, dev)
    model, info = load_model(path, dtype=dtype, device=str(dev), backend="auto")
    if info is None:
        raise QuantkitError(f"{path}: not a quantized checkpoint (config.json has no quantization_config)")
    config = read_config(path)
    spec = spec_for(config)
    notes: list[str] = []
    setup = _Setup(ran, kernel_checked, info.layout, info.bits, info.group_size, max_rel_error, max_rows,
                   spec, spec.layers, None, None)
    if original is not None:
        setup.original = ShardReader(resolve_model_path(str(original)))
        setup.plan = _awq_plan(path, info, notes)
        if setup.plan is None and info.layout == "awq":
            setup.original = None
    if not kernel_checked:
        notes.append(f"backend {ran}: the kernel was not run (no GPU; --backend triton runs it in Triton's "
                     f"interpreter, slowly)")
    ids = calibration_ids(path, calib, nsamples, seqlen, seed, notes)
    quant_linears = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if not quant_linears:
        raise QuantkitError(f"{path}: no packed linears found")
    results: list[LayerCheck] = []
    with progress_bar("check layers", len(quant_linears), show_progress) as advance:
        def hook(name):
            def run(module, args):
                results.append(check_layer(name, module, args[0].detach(), setup))
                advance()
            return run

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in quant_linears]
        try:
            with torch.no_grad():
                model(ids.to(dev))
        finally:
            for h in handles:
                h.remove()
    if kernel_checked and any(layer.kernel_diff is None for layer in results):
        notes.append("layers that are not 4-bit have no W4A16 kernel: only their error against the original is checked")
    return CheckReport(str(path), None if original is None else str(original), ran, kernel_checked, info.layout,
                       info.bits, info.group_size, str(dtype).removeprefix("torch."), str(dev), max_rel_error,
                       results, notes)


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
    from safetensors.torch import load_file

    return load_file(str(file))


def calibration_ids(path: Path, calib: str | None, nsamples: int, seqlen: int, seed: int,
                    notes: list[str]) -> torch.Tensor:
    """[nsamples, seqlen] token ids: windows of `calib` text, or of the synthetic stories."""
    from quantkit.model.checkpoint import read_config
    from quantkit.model.loader import load_tokenizer

    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as exc:
        if calib is not None:
            raise QuantkitError(f"{path}: no usable tokenizer for --calib ({exc})") from exc
        notes.append("no tokenizer in the checkpoint: random token ids used as inputs")
        vocab = int(read_vocab_size(path))
        return torch.randint(0, vocab, (nsamples, seqlen), generator=torch.Generator().manual_seed(seed))
    if calib is not None:
        from quantkit.calibration.data import load_calibration

        calib_set = load_calibration(calib, tokenizer, nsamples, seqlen, seed)
        notes.extend(calib_set.notes)
        return calib_set.input_ids
    from quantkit.calibration.synthetic import make_corpus

    docs = make_corpus(8 * nsamples, seed=seed)  # tokenized one story at a time, then joined
    ids = torch.tensor([t for d in docs for t in tokenizer(d + "\n\n", add_special_tokens=False)["input_ids"]],
                       dtype=torch.int64)
    seqlen = min(seqlen, ids.numel(), int(read_config(path).get("max_position_embeddings") or seqlen))
    starts = torch.linspace(0, ids.numel() - seqlen, nsamples).long()
    return torch.stack([ids[s:s + seqlen] for s in starts.tolist()])


def read_vocab_size(path: Path) -> int:
    from quantkit.model.checkpoint import read_config

    config = read_config(path)
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 32000)
