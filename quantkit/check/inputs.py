"""The inputs `quantkit check` runs a checkpoint on: windows of calibration text, or of the
project's synthetic stories, tokenized with the checkpoint's own tokenizer."""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.model.source import ModelSource


def calibration_ids(source: ModelSource, calib: str | None, nsamples: int, seqlen: int, seed: int,
                    notes: list[str]) -> torch.Tensor:
    """[nsamples, seqlen] token ids: windows of `calib` text, or of the synthetic stories."""
    from quantkit.model.loader import load_tokenizer

    try:
        tokenizer = load_tokenizer(source)
    except (OSError, ValueError) as exc:
        if calib is not None:
            raise QuantkitError(f"{source.path}: no usable tokenizer for --calib ({exc})") from exc
        notes.append("no tokenizer in the checkpoint: random token ids used as inputs")
        vocab = int(vocab_size(source.config))
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
    seqlen = min(seqlen, ids.numel(), source.max_context() or seqlen)
    starts = torch.linspace(0, ids.numel() - seqlen, nsamples).long()
    return torch.stack([ids[s:s + seqlen] for s in starts.tolist()])


def vocab_size(config: dict) -> int:
    """config.json's vocabulary size (a multimodal config's text_config's), 32000 where it says none."""
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 32000)
