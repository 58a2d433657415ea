"""Evaluate one model on the chosen tasks: load, run MMLU and perplexity, time it, cache base results.

One step reads top to bottom in `evaluate_model`: look each task up in the cache (base only),
load the model if anything is left to run, run what is left, store it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from quantkit.errors import QuantkitError
from quantkit.eval.cache import ResultCache
from quantkit.eval.mmlu import MmluResult
from quantkit.eval.perplexity import PplResult
from quantkit.eval.settings import EvalSettings
from quantkit.model.source import ModelSource, open_model


@dataclass
class TaskInputs:
    """What both models are evaluated on, resolved and validated once before any model loads."""

    subjects: list[str] = field(default_factory=list)
    available_subjects: int = 0
    ppl_text: str | None = None


@dataclass
class ModelRun:
    role: str  # "base" or "quantized"
    path: str
    mmlu: MmluResult | None = None
    ppl: PplResult | None = None
    wall_s: float = 0.0  # load + evaluation, this run (0 when everything came from the cache)
    memory_bytes: int = 0  # weights (and dequantized caches) held in memory while evaluating
    cached: list[str] = field(default_factory=list)  # tasks served from the base-result cache
    quantization: str = "not quantized"


@dataclass
class Bars:
    """The rich progress bar the CLI passes down; a bar per (model, task)."""

    bar: object | None = None

    def add(self, description: str, total: int | None = None):
        if self.bar is None:
            return None
        return self.bar.add_task(description, total=total)

    def hook(self, task_id):
        from quantkit.eval.lm_backend import ProgressHook

        if self.bar is None:
            return None
        return ProgressHook(lambda n: self.bar.update(task_id, total=n, completed=0),
                            lambda n: self.bar.advance(task_id, n))

    def advance(self, task_id, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(task_id, n)


def resolve_inputs(settings: EvalSettings) -> TaskInputs:
    """Check the MMLU folder / subjects and read the ppl text before loading any model."""
    from quantkit.eval.mmlu import builtin_subjects, subject_config
    from quantkit.eval.mmlu_data import local_subjects, read_local_subject
    from quantkit.eval.perplexity import read_ppl_text

    from quantkit.model.checkpoint import hub_offline

    inputs = TaskInputs()
    if "mmlu" in settings.tasks and settings.mmlu_dir is None and hub_offline():
        raise QuantkitError("lm-eval's mmlu downloads cais/mmlu from the hub, which is offline; pass --mmlu-dir DIR")
    if "mmlu" in settings.tasks:
        available = local_subjects(settings.mmlu_dir) if settings.mmlu_dir is not None else builtin_subjects()
        wanted = list(settings.subjects) or available
        missing = [s for s in wanted if s not in available]
        if missing:
            raise QuantkitError(f"--subjects: {', '.join(missing)} not available (have: {', '.join(available)})")
        for subject in wanted:
            subject_config(subject)  # unknown to lm-eval's mmlu -> one line
            if settings.mmlu_dir is not None:
                read_local_subject(settings.mmlu_dir, subject)  # malformed rows fail now, not after a model run
        inputs.subjects = wanted
        inputs.available_subjects = len(available)
    if "ppl" in settings.tasks:
        inputs.ppl_text = read_ppl_text(settings.ppl_text)
    return inputs


def model_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers, plus QuantLinear's dequantized weight caches (CPU path)."""
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    for module in model.modules():
        dense = getattr(module, "_dense", None)
        if isinstance(dense, torch.Tensor):
            total += dense.numel() * dense.element_size()
    return total


def evaluate_model(role: str, model: str | ModelSource, settings: EvalSettings, inputs: TaskInputs,
                   progress: Bars | None = None) -> ModelRun:
    progress = progress or Bars()
    source = open_model(model)
    run = ModelRun(role, source.name)
    cache = ResultCache(settings.cache_dir) if settings.cache_dir is not None and role == "base" else None
    keys = task_keys(settings, inputs)
    ckpt = cache.checkpoint_hash(source.path) if cache is not None else None
    for task, key in keys.items():
        hit = cache.get(ckpt, key) if cache is not None else None
        if hit is not None:
            set_result(run, task, hit)
            run.cached.append(task)
    todo = [t for t in keys if t not in run.cached]
    if not todo:
        return run
    start = time.perf_counter()
    lm = load_lm(source, settings, int8_lm_head=settings.cpu_int8_lm_head and role == "quantized")
    run.quantization = getattr(lm, "quantization", NOT_QUANTIZED)
    if "ppl" in todo:
        run.ppl = run_ppl(lm, settings, inputs, progress, role)
    if "mmlu" in todo:
        from quantkit.eval.mmlu import run_mmlu

        lm.progress = progress.hook(progress.add(f"{role}: MMLU"))
        run.mmlu = run_mmlu(lm, inputs.subjects, settings.mmlu_dir, settings.num_fewshot, settings.limit)
    run.wall_s = time.perf_counter() - start
    run.memory_bytes = model_bytes(lm.model)
    for task in todo:
        if cache is not None:
            cache.put(ckpt, keys[task], get_result(run, task))
    return run


def task_keys(settings: EvalSettings, inputs: TaskInputs) -> dict[str, dict]:
    keys = {}
    if "mmlu" in settings.tasks:
        keys["mmlu"] = settings.mmlu_key(inputs.subjects)
    if "ppl" in settings.tasks:
        keys["ppl"] = settings.ppl_key(inputs.ppl_text) | {"source": settings.ppl_text}
    return keys


def set_result(run: ModelRun, task: str, data: dict) -> None:
    if task == "mmlu":
        run.mmlu = MmluResult.from_dict(data)
    else:
        run.ppl = PplResult.from_dict(data)


def get_result(run: ModelRun, task: str) -> dict:
    return run.mmlu.to_dict() if task == "mmlu" else run.ppl.to_dict()


def load_lm(model: str | ModelSource, settings: EvalSettings, int8_lm_head: bool = False):
    """The lm-eval backend over quantkit's loader (QuantLinear for quantized checkpoints); `int8_lm_head`: a float
    lm_head held in int8 as the engine's --cpu-int8-lm-head holds it (a packed one stays as it is)."""
    from quantkit.eval.lm_backend import DTYPES, QuantkitLM
    from quantkit.model.loader import load_model, load_tokenizer

    source = open_model(model)
    model, info = load_model(source, dtype=DTYPES[settings.dtype], device=settings.device)
    lm = QuantkitLM(model=model, tokenizer=load_tokenizer(source), batch_size=settings.batch_size,
                    device=settings.device)
    lm.quantization = describe_quantization(info)
    if int8_lm_head and type(model.lm_head) is torch.nn.Linear and model.lm_head.bias is None:
        from quantkit.kernels.int8_cpu import Int8Linear, int8_head_unavailable

        why = int8_head_unavailable(torch.device(settings.device), DTYPES[settings.dtype], model.lm_head.in_features)
        if why is not None:
            raise QuantkitError(f"--cpu-int8-lm-head: {why}")
        model.lm_head = Int8Linear.from_linear(model.lm_head, fp32_out=True)  # fp32 logits, as the engine's
        lm.quantization += ", lm_head held in int8 (--cpu-int8-lm-head)"
    return lm


NOT_QUANTIZED = "not quantized"


def describe_quantization(info) -> str:
    """What a checkpoint's quantization_config says (a loader QuantInfo), in words."""
    if info is None:
        return NOT_QUANTIZED
    group = "per channel" if info.group_size == -1 else f"group size {info.group_size}"
    return f"{info.method} {info.bits}-bit, {group} ({info.layout} layout)"


def checkpoint_quantization(model: str | ModelSource) -> str:
    """describe_quantization for a checkpoint, from its config.json (or an old AutoGPTQ quantize_config.json)."""
    return describe_quantization(open_model(model).quant)


def run_ppl(lm, settings: EvalSettings, inputs: TaskInputs, progress: Bars, role: str) -> PplResult:
    from quantkit.eval.perplexity import perplexity, tokenize_once

    if settings.seqlen > lm.max_length:
        raise QuantkitError(f"--seqlen {settings.seqlen} is above the model's context of {lm.max_length} tokens")
    ids, bos_note = tokenize_once(lm.tokenizer, inputs.ppl_text)
    windows = len(ids) // settings.seqlen
    bar = progress.add(f"{role}: perplexity", total=windows if settings.limit is None else min(windows, settings.limit))
    return perplexity(lm.model, ids, settings.seqlen, settings.ppl_text, bos_note, settings.batch_size,
                      advance=lambda n: progress.advance(bar, n), device=settings.device, limit=settings.limit)


def model_context(model: str | ModelSource) -> int:
    """A checkpoint's context length (max_position_embeddings and kin), from its config.json."""
    from types import SimpleNamespace

    from quantkit.eval.lm_backend import model_context_length

    return model_context_length(SimpleNamespace(**open_model(model).config))


def clip_seqlen(settings: EvalSettings, models: tuple[str | ModelSource, ...]) -> tuple[EvalSettings, str | None]:
    """--seqlen clipped to the shortest context of `models` (as quantize does), with a note saying so."""
    from dataclasses import replace

    context = min(model_context(m) for m in models)
    if settings.seqlen <= context:
        return settings, None
    return replace(settings, seqlen=context), f"--seqlen {settings.seqlen} clipped to the models' context of {context} tokens"
