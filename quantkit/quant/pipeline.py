"""The layer loop (the IST-DASLab/gptq flow), memory-bounded.

  resolve + validate -> plan which linears can be packed (quantkit.quant.planning) -> calibration windows
  -> capture layer 0's inputs -> for each decoder layer (quantkit.quant.layer_step):
        read its weights from the shards (memory-mapped) -> method.quantize_layer
           (an MoE layer's experts: each packed and handed to the shard writer as soon as it is quantized)
        -> re-run the layer with quantized weights -> its outputs feed the next layer
        -> pack + hand its other tensors to the shard writer -> drop the layer
  -> embeddings / final norm / lm_head copied as they are -> configs, metadata.

Only one decoder layer and the activations are in memory at a time (the embeddings too, until
layer 0's inputs are captured): the reader releases the source pages it has read and the writer
streams each tensor to disk. `python benchmarks/memory.py` measures this.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quantkit.config import QuantizeConfig
from quantkit.devices import compute_dtype, resolve_device
from quantkit.errors import QuantkitError
from quantkit.memory import release_freed_memory
from quantkit.model.checkpoint import ShardReader
from quantkit.model.fingerprint import weights_fingerprint
from quantkit.model.loader import build_skeleton
from quantkit.model.source import ModelSource, open_model
from quantkit.progress import progress_bar
from quantkit.format.arch import get_submodule
from quantkit.format.awq_plan import PLAN_FILE, layer_prefix, save_plan
from quantkit.quant.lm_head import LM_HEAD, quantize_lm_head, refuse_tied
from quantkit.quant.calib_amount import CalibrationAmount
from quantkit.quant.capture import batch_samples, capture_layer_inputs
from quantkit.quant.layer_step import LayerReport, check_finite, load_tensors, quantize_one_layer
from quantkit.quant.methods import LayerMethod
from quantkit.quant.planning import QuantizePlan, float_modules, plan_quantization, skipped_fused_names
from quantkit.quant.shard_writer import ShardWriter
from quantkit.quant.writer import quantization_config, write_metadata

# method name (quantkit.config.METHODS) -> the module and class that implement it; a module is imported only when its
# method is asked for, so AWQ's search and GPTQ's solver stay unloaded for the runs that do not use them
METHOD_CLASSES = {"rtn": ("quantkit.quant.rtn", "RTNMethod"), "gptq": ("quantkit.quant.gptq_layer", "GPTQMethod"),
                  "awq": ("quantkit.quant.awq", "AWQMethod")}


def make_method(cfg: QuantizeConfig) -> LayerMethod:
    """The method named by cfg.method (one of quantkit.config.METHODS, which the config checked)."""
    if cfg.method not in METHOD_CLASSES:
        raise ValueError(f"no quantization method {cfg.method!r}: add it to METHOD_CLASSES and quantkit.config.METHODS")
    module, name = METHOD_CLASSES[cfg.method]
    return getattr(importlib.import_module(module), name)(cfg)


log = logging.getLogger("quantkit.quant")

@dataclass
class QuantizeReport:
    plan: QuantizePlan
    layers: list[LayerReport]
    out: Path | None
    seconds: float
    output_bytes: int
    calib_hash: str | None

    @property
    def mean_loss(self) -> float:
        losses = [v for layer in self.layers for v in layer.losses.values()]
        return sum(losses) / len(losses) if losses else 0.0


def quantize_model(cfg: QuantizeConfig, out_dir: Path | None = None, show_progress: bool = True,
                   warn: Callable[[str], None] = log.warning, source: ModelSource | None = None) -> QuantizeReport:
    """Quantize cfg.model into `out_dir` (an empty folder). With cfg.dry_run, only plan. `warn` says a warning
    the moment it arises (cfg.strict turns it into a QuantkitError); the plan keeps it too.

    The report's seconds (quantkit_meta.json's wall_seconds) start after transformers' code for
    the model and the method's own modules are imported (import_seconds, kept apart), as llm-compressor's `oneshot`
    call, which the benchmarks time, starts after its imports. `source`: cfg.model already opened (open_model)."""
    source = open_model(cfg.model if source is None else source)
    path, config_dict = source.path, source.config
    import_seconds = 0.0 if cfg.dry_run or out_dir is None else import_model_code(source) + import_method_code(cfg)
    start = time.perf_counter()
    plan = plan_quantization(cfg, source)
    reader = source.reader
    if cfg.quantize_lm_head:
        refuse_tied(config_dict)
    if cfg.dry_run or out_dir is None:
        return QuantizeReport(plan, [], None, time.perf_counter() - start, 0, None)

    device = resolve_device(cfg.device)
    dtype, why = compute_dtype(cfg.compute_dtype, device)
    method = make_method(cfg)
    hf_cfg = source.hf_config
    model = build_skeleton(hf_cfg, torch.float32)
    calib = None
    if method.needs_calibration:
        calib = _calibration(cfg, path, plan, show_progress)
        _check_calibration_amount(cfg, plan, reader, calib, warn)
        plan.notes.extend(calib.notes)
        plan.notes.append(f"calibration forward passes in {str(dtype).removeprefix('torch.')}: {why}")
    reports, plan_tensors = _quantize_layers(cfg, method, plan, reader, model, hf_cfg, calib, device, dtype, out_dir,
                                             show_progress)
    reader.close()
    if plan_tensors:
        save_plan(plan_tensors, out_dir / PLAN_FILE)
    report = QuantizeReport(plan, reports, out_dir, time.perf_counter() - start, 0, calib.token_hash if calib else None)
    qconfig = quantization_config(cfg, list(plan.skipped) + float_modules(plan), skipped_fused_names(plan))
    meta = {**_meta(cfg, report), "import_seconds": round(import_seconds, 3),
            "source_fingerprint": weights_fingerprint(reader)}  # `quantkit eval` checks its --base against it
    write_metadata(out_dir, path, config_dict, qconfig, meta)
    report.output_bytes = sum(f.stat().st_size for f in out_dir.iterdir() if f.suffix == ".safetensors")
    return report


def _quantize_layers(cfg: QuantizeConfig, method, plan: QuantizePlan, reader: ShardReader, model, hf_cfg, calib,
                     device, dtype, out_dir: Path, show_progress: bool) -> tuple[list, dict]:
    """Each layer in turn, written as it is done, then the tensors outside the layers: (the layers' reports, the
    search's plan tensors by checkpoint name). Layer 0 reads the calibration windows' hidden states (none without
    `calib`); each layer's inputs are let go once its outputs exist (this frame holds the only reference)."""
    spec = plan.spec
    layers = get_submodule(model, spec.layers)
    inputs, layer_kwargs = [], [{} for _ in range(plan.num_layers)]
    if calib is not None:
        inputs, layer_kwargs = _first_layer_inputs(model, reader, spec, calib.input_ids, device)
    # the float model's stream beside the quantized one (GPTAQ): the same tensors into layer 0
    float_inputs = list(inputs) if method.needs_float_stream and inputs else None
    reports, plan_tensors = [], {}
    with ShardWriter(out_dir, cfg.max_shard_size) as writer, \
            progress_bar(f"{cfg.method} layers", plan.num_layers, show_progress) as advance:
        for i in range(plan.num_layers):
            step = quantize_one_layer(cfg, method, plan, reader, layers, i, hf_cfg, inputs, layer_kwargs[i],
                                      device, writer, dtype, float_inputs)
            inputs, float_inputs = step.outputs, step.float_outputs
            plan_tensors.update({layer_prefix(i) + k: v for k, v in step.plan.items()})
            reports.append(step.report)
            if cfg.low_memory:
                release_freed_memory()
            advance()
        _copy_outside_layers(cfg, reader, writer, spec.layers)
        writer.finish()
    return reports, plan_tensors


def _check_calibration_amount(cfg: QuantizeConfig, plan: QuantizePlan, reader: ShardReader, calib, warn) -> None:
    """Too little calibration text for the widest quantized linear: a warning, or under --strict an error."""
    widest = max(plan.quantized, key=lambda name: reader.shape_of(f"{name}.weight")[1])
    windows, window = calib.input_ids.shape
    amount = CalibrationAmount(calib.text_tokens, windows, window, plan.seqlen, widest,
                               reader.shape_of(f"{widest}.weight")[1], cfg.group_size)
    if (shortfall := amount.shortfall()) is None:
        return
    if cfg.strict:
        raise QuantkitError(f"{shortfall}; refused (--strict)")
    plan.warnings.append(shortfall)
    warn(shortfall)


def _first_layer_inputs(model, reader: ShardReader, spec, input_ids, device) -> tuple[list, list[dict]]:
    """The calibration samples' hidden states entering layer 0 (batched) and each layer's other arguments.

    Of the input embeddings only the rows of the calibration's distinct tokens are read, in fp32 (a few MB, where
    the whole table is 2.1 GB in fp32 at Llama 3's 128256 x 4096), and the model's own embedding module looks the
    samples up in them (renumbered), its output fed to the model as inputs_embeds: the same fp32 values as the whole
    table gives, scaled embeddings included. Dropped after this pass (not needed past layer 0)."""
    embed = get_submodule(model, spec.embed)
    weight_key = f"{spec.embed}.weight"
    tokens, renumbered = torch.unique(input_ids, return_inverse=True)  # tokens [distinct], renumbered [n, seq]
    load_tensors(model, reader, [k for k in reader.keys() if k.startswith(spec.embed + ".") and k != weight_key],
                  device)
    rows = reader.rows(weight_key, tokens).float().to(device)  # [distinct, hidden]
    check_finite({"weight": rows}, spec.embed)
    embed.weight = torch.nn.Parameter(rows, requires_grad=False)  # the table's shape differs: not load_state_dict
    del rows
    padding_idx, embed.padding_idx = embed.padding_idx, None  # padding only shapes gradients; its id may be past the rows
    try:
        with progress_bar("capture layer 0 inputs", None, False):
            inputs, layer_kwargs = capture_layer_inputs(get_submodule(model, spec.layers.rpartition(".")[0]),
                                                        get_submodule(model, spec.layers), renumbered, device, embed)
    finally:
        embed.padding_idx = padding_idx
        embed.to("meta")
    return batch_samples(inputs), layer_kwargs


def _copy_outside_layers(cfg: QuantizeConfig, reader: ShardReader, writer: ShardWriter, layers_prefix: str) -> None:
    """Every tensor outside the decoder layers as it is (embeddings, final norm, lm_head), one at a time
    (they are the largest), their bytes copied file to file; lm_head packed with --quantize-lm-head."""
    for key in [k for k in reader.keys() if not k.startswith(layers_prefix + ".")]:
        if cfg.quantize_lm_head and key == f"{LM_HEAD}.weight":
            writer.add(quantize_lm_head(reader.get(key), cfg.scheme, cfg.layout).tensors)
            continue
        writer.add_stored(key, reader.entry(key), reader.path)


def import_method_code(cfg: QuantizeConfig) -> float:
    """Import the module of cfg.method (METHOD_CLASSES) and what it imports; returns the seconds it took."""
    t0 = time.perf_counter()
    importlib.import_module(METHOD_CLASSES[cfg.method][0])
    return time.perf_counter() - t0


def import_model_code(source: ModelSource) -> float:
    """Import transformers and the modules this model's config, CausalLM class and tokenizer live
    in (imported lazily on first use); returns the seconds it took (a fresh process: ~1-3 s)."""
    t0 = time.perf_counter()
    from transformers import AutoTokenizer  # noqa: F401  (the tokenizer classes, used by _calibration)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config_class = type(source.hf_config)
    if config_class in MODEL_FOR_CAUSAL_LM_MAPPING:
        MODEL_FOR_CAUSAL_LM_MAPPING[config_class]  # imports the modeling module (a lazy mapping)
    return time.perf_counter() - t0


def _calibration(cfg: QuantizeConfig, path: Path, plan: QuantizePlan, show_progress: bool = True):
    from transformers import AutoTokenizer

    from quantkit.calibration.data import load_calibration

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    with progress_bar("calibration windows", cfg.calib.nsamples, show_progress) as advance:
        calib = load_calibration(cfg.calib.source, tokenizer, cfg.calib.nsamples, plan.seqlen, cfg.calib.seed)
        advance(int(calib.input_ids.shape[0]))
    return calib


def _meta(cfg: QuantizeConfig, report: QuantizeReport) -> dict:
    from quantkit import __version__

    return {
        "quantkit_version": __version__,
        "config": cfg.to_dict(),
        "source": str(report.plan.model_path),
        "calibration_token_sha256": report.calib_hash,
        "seqlen": report.plan.seqlen,
        "notes": report.plan.notes,
        "warnings": report.plan.warnings,
        "quantized_modules": report.plan.quantized,
        "skipped_modules": report.plan.skipped,
        "layers": [asdict(layer) for layer in report.layers],
        "wall_seconds": round(report.seconds, 3),
    }


def load_meta(qdir: Path) -> dict:
    return json.loads((Path(qdir) / "quantkit_meta.json").read_text())
