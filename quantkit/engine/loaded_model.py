"""What the engine loads before it can schedule: the decoder in its dtype on its device, the tokenizer, the EOS ids
and the context length (LLMEngine then sizes the KV cache for it)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.devices import auto_cpu_dtype, resolve_device
from quantkit.engine.config import EngineConfig
from quantkit.engine.decoder import Decoder
from quantkit.engine.huge_pages import HugePages, move_to_huge_pages
from quantkit.engine.weights import MappedEmbedding, load_decoder
from quantkit.model.quant_format import QuantInfo
from quantkit.errors import QuantkitError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("quantkit.engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    device: torch.device
    dtype: torch.dtype
    model: Decoder
    quant_info: QuantInfo | None
    tokenizer: PreTrainedTokenizerBase
    eos_ids: frozenset[int]
    max_model_len: int
    huge_pages: HugePages  # where the weights were moved into transparent huge pages (CPU)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto" and device.type == "cpu":
        name, why = auto_cpu_dtype()
        log.info("dtype %s: %s", name, why)
    if name == "auto":
        return torch.float16
    if name == "float16" and device.type == "cpu":
        raise QuantkitError("float16 on CPU is too slow to serve; use float32 or bfloat16")
    return DTYPES[name]


def eos_token_ids(path: Path, config_eos, tokenizer) -> frozenset[int]:
    """EOS ids as HF generate takes them: generation_config.json, else config.json, else the tokenizer."""
    gen = path / "generation_config.json"
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    for value in (gen_eos, config_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            return frozenset([value])
        if isinstance(value, list) and value:
            return frozenset(int(v) for v in value)
    return frozenset()


def context_length(asked: int | None, limit: int) -> int:
    """The engine's max_model_len: as asked (at most the model's max_position_embeddings `limit`), else the limit."""
    n = asked or limit
    if n > limit:
        raise QuantkitError(f"max_model_len {n} exceeds the model's max_position_embeddings {limit}")
    return n


def load_engine_model(cfg: EngineConfig) -> LoadedModel:
    """cfg.model read once (its path, config, spec, scheme and shards) into the engine's dtype and device."""
    from quantkit.model.loader import load_tokenizer
    from quantkit.model.source import open_model

    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)  # asked for explicitly: a process-wide torch setting
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        from quantkit.kernels.cpu_status import kernel_statuses, one_line

        log.info(one_line(kernel_statuses()))  # which C++ kernels this start runs, as `quantkit env` says
    dtype = resolve_dtype(cfg.dtype, device)
    source = open_model(cfg.model)
    model, quant_info = load_decoder(source, dtype, device, cfg.cpu_int8_activations, cfg.cpu_int8_lm_head,
                                     cfg.cpu_int8_prefill)
    if not cfg.cpu_huge_pages or device.type != "cpu":
        huge_pages = HugePages(skipped="--no-cpu-huge-pages" if device.type == "cpu" else f"weights on {device}")
    else:
        huge_pages = move_to_huge_pages(model, skip=(MappedEmbedding,))  # after repacking: the tensors decode reads
        log.info(huge_pages.describe())
    tokenizer = load_tokenizer(cfg.tokenizer or source)
    max_model_len = context_length(cfg.max_model_len, model.shape.max_position_embeddings)
    model.use_rope_table(max_model_len)
    eos = eos_token_ids(source.path, getattr(source.hf_config, "eos_token_id", None), tokenizer)
    return LoadedModel(device, dtype, model, quant_info, tokenizer, eos, max_model_len, huge_pages)
