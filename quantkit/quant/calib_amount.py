"""Is there enough calibration text? A rule of thumb, said with the numbers behind it.

GPTQ fits each linear's update to the Hessian X^T X of its calibration inputs, and AWQ its scales to their
activations: with few distinct tokens the Hessian has low rank and the fit is to noise, and the checkpoint comes
out no better than round-to-nearest (or worse). Windows are cut from the text at random offsets, so their
distinct tokens are at most the text's. The floor: one window (of the --seqlen asked for) per 16 quantization
groups of the widest linear's input, e.g. 6 windows of 2048 for Llama-2-7B's down_proj (11008 inputs, 86
groups of 128); per channel (one group) it is one window.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUPS_PER_WINDOW = 16


@dataclass(frozen=True)
class CalibrationAmount:
    """The calibration set against the floor for one model and scheme."""

    text_tokens: int  # tokens in the whole calibration text
    windows: int
    window: int  # tokens per window, as cut (lowered to the text's length when the text is shorter)
    asked_window: int  # --seqlen, clipped to the model's context
    layer: str  # the widest quantized linear
    in_features: int
    group_size: int  # -1: per channel

    @property
    def tokens(self) -> int:
        """Distinct tokens the windows can hold: no more than the text has."""
        return min(self.text_tokens, self.windows * self.window)

    @property
    def groups(self) -> int:
        return 1 if self.group_size == -1 else -(-self.in_features // self.group_size)

    @property
    def floor(self) -> int:
        return -(-self.groups // GROUPS_PER_WINDOW) * self.asked_window

    def shortfall(self) -> str | None:
        """What is wrong, in one line, or None when there is enough."""
        if self.tokens >= self.floor:
            return None
        repeated = (f"; {self.windows} windows of {self.window} tokens repeat them"
                    if self.windows * self.window > self.text_tokens else "")
        per = "per channel" if self.group_size == -1 else f"{self.groups} groups of {self.group_size}"
        return (f"only {self.tokens} calibration tokens (the text has {self.text_tokens}{repeated}): fewer than "
                f"{self.floor}, one window of {self.asked_window} per {GROUPS_PER_WINDOW} groups of the widest layer "
                f"({self.layer}: {self.in_features} inputs, {per}). The fit is to so few tokens that the result is "
                f"no better than RTN, or worse: give more text with --calib")
