"""A quantized lm_head, as GPTQModel's `lm_head=True` writes it and vLLM's GPTQ config field `lm_head` reads it.

The output projection is rounded to nearest with the checkpoint's scheme and stored packed under the
`lm_head.` prefix (qweight, qzeros, scales, g_idx), like every decoder linear; quantization_config
carries `"lm_head": true`. Tied embeddings are refused: the embedding table must stay float.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.format.primitives import QuantScheme, rtn_quantize
from quantkit.quant.writer import packed_tensors

LM_HEAD = "lm_head"


@dataclass(frozen=True)
class LmHeadResult:
    tensors: dict[str, torch.Tensor]  # the packed checkpoint tensors under "lm_head."
    loss: float  # squared error of the dequantized weight, summed


def refuse_tied(config_dict: dict) -> None:
    if config_dict.get("tie_word_embeddings", False):
        raise QuantkitError("--quantize-lm-head: this model ties lm_head to the embedding table, which must stay "
                            "float; quantize without --quantize-lm-head")


def quantize_lm_head(weight: torch.Tensor, scheme: QuantScheme, layout: str) -> LmHeadResult:
    """weight: [vocab, hidden] float -> the packed lm_head tensors in `layout` (round to nearest)."""
    w = weight.float()
    qw = rtn_quantize(w, scheme)
    loss = float(torch.sum((w - qw.dequantize().float()) ** 2))
    return LmHeadResult(packed_tensors(qw, layout, LM_HEAD), loss)
