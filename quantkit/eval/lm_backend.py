"""quantkit's model backend for lm-eval: batched loglikelihood over float or quantized checkpoints.

Quantized checkpoints load through `quantkit.model.loader.load_model` (QuantLinear), so an
lm-eval run measures quantkit's own dequantization / W4A16 numerics, not a transformers
quantizer. Tokenization, the context/continuation split and left truncation follow lm-eval's
`hf` model exactly (TemplateLM._encode_pair, `(ctx + cont)[-(max_length + 1):][:-1]`), so
the two give the same choices on the same questions.

Importing this module registers the backend with lm-eval as `quantkit`, so
`lm_eval --model quantkit --model_args pretrained=DIR` works once it has been imported
(or through the `lm_eval.models` entry point, if the package declares one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from quantkit.devices import resolve_device
from quantkit.eval.windows import ScoreWindow, batches_by_length, score_window

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ProgressHook:
    """Called as `start(total_forwards)` once per request list, then `advance(n)` after each batch."""

    start: Callable[[int], None]
    advance: Callable[[int], None]


def model_context_length(config) -> int:
    """The model's window, from the same config attributes lm-eval consults."""
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


@register_model("quantkit")
class QuantkitLM(TemplateLM):
    """lm-eval LM over a quantkit-loaded model; loglikelihood tasks only (MMLU, ppl-style tasks)."""

    def __init__(self, pretrained: str | None = None, model=None, tokenizer=None, batch_size: int | str = 16,
                 max_length: int | None = None, dtype: str = "float32", device: str = "auto",
                 add_bos_token: bool | None = None, progress: ProgressHook | None = None,
                 max_batch_size: int | None = None):
        # max_batch_size: lm-eval's CLI always passes it; batches here are fixed-size, so it is unused
        super().__init__()
        device = str(resolve_device(device))  # auto: what is there, as the rest of quantkit picks it
        if model is None:
            from quantkit.model.loader import load_model, load_tokenizer

            if pretrained is None:
                raise ValueError("quantkit backend: pass model_args pretrained=DIR")
            model, _ = load_model(pretrained, dtype=DTYPES[str(dtype)], device=device)
            tokenizer = tokenizer or load_tokenizer(pretrained)
        self.model = model
        self.tokenizer = tokenizer
        self._device = torch.device(device)
        self._batch_size = int(batch_size) if str(batch_size) != "auto" else 16
        self._max_length = int(max_length) if max_length else model_context_length(model.config)
        self.add_bos_token = add_bos_token
        self.progress = progress
        self.truncated_contexts: set[tuple[int, ...]] = set()  # distinct contexts cut from the left
        self.forwards = 0  # model inputs actually run (requests sharing an input share a forward)

    # --- the TemplateLM contract -------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As lm-eval's `hf`: the tokenizer's own special-token default unless told, no double BOS."""
        if add_special_tokens is not None:
            kw = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            kw = {"add_special_tokens": self.add_bos_token}
        else:
            kw = {}
        bos = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and bos and string.startswith(bos):
            kw["add_special_tokens"] = False
        return self.tokenizer.encode(string, **kw)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # lm-eval's tokenizing bar is replaced by our own progress hook when one is set
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.progress is not None)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        windows = [score_window(list(ctx), list(cont), self.max_length) for _, ctx, cont in requests]
        for (_, ctx, _), w in zip(requests, windows):
            if w.truncated:
                self.truncated_contexts.add(tuple(ctx))
        scores = self._score_windows(windows)
        return [scores[(w.inp, w.cont)] for w in windows]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        out = []
        for (string,) in [req.args for req in requests]:
            pairs = [utils.make_disjoint_window(p) for p in utils.get_rolling_token_windows(
                token_list=self.tok_encode(string, add_special_tokens=False), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            reqs = [((None, None), list(ctx), list(cont)) for ctx, cont in pairs]
            out.append(sum(ll for ll, _ in self._loglikelihood_tokens(reqs)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("the quantkit lm-eval backend scores loglikelihood tasks only "
                                  "(multiple choice, perplexity); generation tasks are not supported")

    # --- scoring -----------------------------------------------------------------------------
    def _score_windows(self, windows: list[ScoreWindow]) -> dict[tuple, tuple[float, bool]]:
        """One forward per distinct input: MMLU's four one-token answers share their context's."""
        by_input: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        for w in windows:
            by_input.setdefault(w.inp, set()).add(w.cont)
        batches = batches_by_length(list(by_input), self._batch_size)
        if self.progress is not None:
            self.progress.start(len(by_input))
        scores: dict[tuple, tuple[float, bool]] = {}
        for batch in batches:
            logprobs = self._forward_logprobs(batch)  # [B, T, V] fp32
            for row, inp in enumerate(batch):
                for cont in by_input[inp]:
                    scores[(inp, cont)] = continuation_score(logprobs[row, : len(inp)], cont)
            self.forwards += len(batch)
            if self.progress is not None:
                self.progress.advance(len(batch))
        return scores

    @torch.no_grad()
    def _forward_logprobs(self, batch: list[tuple[int, ...]]) -> torch.Tensor:
        # ids: [B, T] right-padded; causal attention means padding never reaches a real position.
        width = len(batch[0])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for i, inp in enumerate(batch):
            ids[i, : len(inp)] = torch.tensor(inp, dtype=torch.long)
        logits = self.model(ids.to(self._device)).logits
        return F.log_softmax(logits.float(), dim=-1).cpu()


def continuation_score(logprobs: torch.Tensor, cont: tuple[int, ...]) -> tuple[float, bool]:
    """(sum of log p(cont), cont is the greedy choice) from logprobs [inplen, V] of one input."""
    tail = logprobs[-len(cont):]  # [len(cont), V]: the positions that predict the continuation
    target = torch.tensor(cont, dtype=torch.long)
    ll = tail.gather(1, target[:, None]).sum()
    return float(ll), bool((tail.argmax(-1) == target).all())
