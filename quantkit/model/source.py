"""One read of a model: a checkpoint resolved once into a typed description that every command takes.

`open_model(name)` resolves a folder or hub id (downloading nothing twice) and reads `config.json` once; the rest
(the architecture spec, the quantization scheme, the shard index, transformers' config object) is derived from that
read the first time it is asked for and kept. Quantize, check, eval and the engine take a `ModelSource`, so one start
resolves the path once, parses config.json once and opens the shards' headers once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from quantkit.model.checkpoint import ShardReader, read_config, resolve_model_path


@dataclass(frozen=True, eq=False)
class ModelSource:
    """A resolved checkpoint folder and its config.json, with what is derived from them, each computed once."""

    name: str  # as the user gave it (a folder or a hub id): what reports and messages show
    path: Path  # the local folder (a hub id's snapshot in the HF cache)
    config: dict = field(repr=False)  # config.json as stored (with quantization_config, where it has one)

    @cached_property
    def spec(self):
        """The architecture's spec (quantkit.format.arch); an unsupported architecture is a QuantkitError here,
        naming the supported ones."""
        from quantkit.format.arch import spec_for

        return spec_for(self.config)

    @cached_property
    def quant(self):
        """The quantization scheme (a QuantInfo), or None for a float checkpoint."""
        from quantkit.model.quant_format import checkpoint_quant_info

        return checkpoint_quant_info(self.path, self.config)

    @cached_property
    def reader(self) -> ShardReader:
        """The shards' index (every header read, no data); MXFP4 experts read dequantized, and stacked experts
        (gpt-oss) one linear per expert (quantkit.model.mxfp4_reader, quantkit.model.stacked_experts)."""
        from quantkit.errors import QuantkitError
        from quantkit.format.arch import spec_for
        from quantkit.format.mxfp4 import is_mxfp4
        from quantkit.model.mxfp4_reader import Mxfp4Reader
        from quantkit.model.stacked_experts import PerExpertReader

        reader = Mxfp4Reader(self.path) if is_mxfp4(self.config) else ShardReader(self.path)
        try:
            experts = spec_for(self.config).experts
        except QuantkitError:  # an architecture quantkit does not know: its tensors as stored
            return reader
        return PerExpertReader(reader, experts) if experts is not None and experts.stacked else reader

    @cached_property
    def hf_config(self):
        """transformers' config object, built from the config.json already read (without quantization_config:
        quantkit loads packed weights itself, never through a transformers quantizer)."""
        from transformers import CONFIG_MAPPING, AutoConfig

        data = copy.deepcopy(self.config)
        data.pop("quantization_config", None)
        if data.get("model_type") not in CONFIG_MAPPING:  # an old config without model_type: transformers' guess
            cfg = AutoConfig.from_pretrained(str(self.path))
            if hasattr(cfg, "quantization_config"):
                del cfg.quantization_config
            return cfg
        return CONFIG_MAPPING[data["model_type"]].from_dict(data)

    def with_spec(self, spec) -> ModelSource:
        """This source with its architecture spec replaced (an ablation's variant of the real spec); the rest, already
        derived or not, is shared."""
        other = copy.copy(self)
        other.__dict__["spec"] = spec  # the frozen dataclass's cached_property slot
        return other

    def max_context(self) -> int | None:
        """The context length config.json states (max_position_embeddings), or None."""
        value = self.config.get("max_position_embeddings")
        return int(value) if value else None


def open_model(name: str | Path | ModelSource) -> ModelSource:
    """A checkpoint folder or hub id, resolved and its config.json read (a ModelSource is returned as it is)."""
    if isinstance(name, ModelSource):
        return name
    path = resolve_model_path(str(name))
    return ModelSource(str(name), path, read_config(path))
