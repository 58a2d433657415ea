"""Was QUANTIZED made from BASE? `quantkit eval` compares the two, and a delta against another model means nothing
(a perplexity ratio of 0.06 between two unrelated models looks like a miracle, not an error).

What is compared, each where both sides have it: the architecture and the shapes in config.json; the tokenizer
(vocabulary, BOS and EOS); and, for a checkpoint quantkit made, the fingerprint of the weights it was made from
(quantkit_meta.json's `source_fingerprint`) against BASE's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.model.fingerprint import weights_fingerprint
from quantkit.model.source import ModelSource, open_model

SHAPE_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")


def config_shape(config: dict) -> dict:
    """The architecture and shape fields of a config.json, with the defaults transformers fills in."""
    c = config.get("text_config", config)
    shape = {k: c.get(k) for k in SHAPE_KEYS}
    if shape["num_key_value_heads"] is None:
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    if shape["head_dim"] is None and shape["hidden_size"] and shape["num_attention_heads"]:
        shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    return {"architectures": c.get("architectures", config.get("architectures")), **shape}


def config_mismatch(quantized: dict, base: dict) -> str | None:
    q, b = config_shape(quantized), config_shape(base)
    diffs = [f"{k} {q[k]} vs {b[k]}" for k in q if q[k] is not None and b[k] is not None and q[k] != b[k]]
    return f"config.json: {', '.join(diffs)} (quantized vs base)" if diffs else None


def recorded_source(folder: Path) -> str | None:
    """The source fingerprint quantize recorded in quantkit_meta.json; None where there is none (another tool's
    checkpoint, or one quantized before quantkit recorded it)."""
    try:
        return json.loads((folder / "quantkit_meta.json").read_text()).get("source_fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def base_mismatches(quantized: str | ModelSource, base: str | ModelSource) -> list[str]:
    """How BASE differs from the checkpoint QUANTIZED was made from ([]: nothing says it is another model)."""
    quantized, base = open_model(quantized), open_model(base)
    found = [m] if (m := config_mismatch(quantized.config, base.config)) else []
    recorded = recorded_source(quantized.path)
    if recorded is not None and (actual := weights_fingerprint(base.reader)) != recorded:
        found.append(f"quantkit_meta.json's source_fingerprint {recorded} is not the base's weights ({actual})")
    if (tokenizers := tokenizer_mismatch(quantized, base)) is not None:
        found.append(f"tokenizer: {tokenizers}")
    return found


def tokenizer_mismatch(quantized: str | ModelSource, base: str | ModelSource) -> str | None:
    """A one-line description of how the two tokenizers differ, or None when they agree."""
    from quantkit.model.loader import load_tokenizer

    q, b = load_tokenizer(quantized), load_tokenizer(base)
    if q.get_vocab() != b.get_vocab():
        return f"the vocabularies differ ({len(q.get_vocab())} vs {len(b.get_vocab())} tokens, quantized vs base)"
    for attr in ("bos_token_id", "eos_token_id"):
        if getattr(q, attr) != getattr(b, attr):
            return f"{attr} differs ({getattr(q, attr)} vs {getattr(b, attr)}, quantized vs base)"
    return None
