"""The quantization methods quantkit.bench.vs_llmcompressor runs by name (its --methods), as each tool's arguments:
`quantkit quantize`'s, llm-compressor's worker's (tests/interop/llmcompressor_gptq.py) and GPTQModel's
(tests/interop/gptqmodel_gptq.py), None where a tool does not run the method.

- rtn: asymmetric RTN; rtn-sym: symmetric RTN (the CLI's default for RTN);
- rtn-mse, rtn-imatrix: asymmetric RTN with searched group scales (--scale-search mse: data-free; imatrix);
  rtn-mse-sym: symmetric, searched by mse;
- gptq: symmetric GPTQ (damp 0.01, block 128, no act-order; GPTQModel with its default act_group_aware, GAR, on);
  gptq-imatrix: GPTQ with imatrix-searched groups; gptq-gar: GPTQ with group-aware act-order (GAR); gptq-gar-lazy:
  the same with --no-static-groups (quantkit only, all three); gptq-nogar: GPTQModel's GPTQ with GAR off (GPTQModel
  only);
- gptaq, gptaq-1, gptaq-gar: GPTQ with asymmetric calibration (--gptaq) at alpha 0.25 and 1, and with GAR
  (GPTQModel: its gptaq, alpha alike); gptaq-nots: GPTAQ with --no-true-sequential (quantkit only);
- awq, awq-duo, awq-both: asymmetric AWQ without / with duo scaling / with both formulas searched per group.
"""

from __future__ import annotations

from typing import NamedTuple


class Method(NamedTuple):
    """One --methods name: each tool's arguments, None where that tool does not run it."""

    ours: list[str] | None  # `quantkit quantize` args
    peer: list[str] | None  # llm-compressor's worker (tests/interop/llmcompressor_gptq.py)
    gptqmodel: list[str] | None = None  # GPTQModel's worker (tests/interop/gptqmodel_gptq.py)


METHODS = {
    "rtn": Method(["--method", "rtn", "--no-sym", "--format", "awq"], ["--method", "rtn"]),
    "gptq": Method(["--method", "gptq"], ["--method", "gptq"], ["--gar", "true"]),  # GAR: GPTQModel's default
    "awq": Method(["--method", "awq", "--awq-duo-scaling", "false"], ["--method", "awq"]),
    "awq-duo": Method(["--method", "awq", "--awq-duo-scaling", "true"], ["--method", "awq", "--duo", "true"]),
    "awq-both": Method(["--method", "awq", "--awq-duo-scaling", "both"], ["--method", "awq", "--duo", "both"]),
    "awq-nogain": Method(["--method", "awq", "--awq-duo-scaling", "false", "--no-awq-row-gain"], None),  # before 12-08
    # quantkit's searched group scales (no llm-compressor counterpart run here: --tools peer skips them)
    "rtn-mse": Method(["--method", "rtn", "--no-sym", "--format", "awq", "--scale-search", "mse"], None),
    # the data-free mode as `quantkit quantize --method rtn --scale-search mse` runs it by default (symmetric, GPTQ
    # layout), and its min-max baseline
    "rtn-sym": Method(["--method", "rtn"], None),
    "rtn-mse-sym": Method(["--method", "rtn", "--scale-search", "mse"], None),
    "rtn-prior": Method(["--method", "rtn", "--no-sym", "--format", "awq", "--scale-search", "prior"], None),
    "rtn-imatrix": Method(["--method", "rtn", "--no-sym", "--format", "awq", "--scale-search", "imatrix"], None),
    "gptq-imatrix": Method(["--method", "gptq", "--scale-search", "imatrix"], None),
    # quantkit's GPTQ with group-aware act-order (GAR), as GPTQModel's `gptq` runs by default
    "gptq-gar": Method(["--method", "gptq", "--act-group-aware"], None),
    # the same with each group's scale taken when the loop reaches it (--no-static-groups, GPTQModel's own setting)
    "gptq-gar-lazy": Method(["--method", "gptq", "--act-group-aware", "--no-static-groups"], None),
    # quantkit's GPTQ with asymmetric calibration (GPTAQ) at its default alpha 0.25 and at the exact objective
    # (GPTQModel's: QuantizeConfig.gptaq, the same alpha, GAR as named)
    "gptaq": Method(["--method", "gptq", "--gptaq"], None, ["--gar", "false", "--gptaq", "0.25"]),
    "gptaq-1": Method(["--method", "gptq", "--gptaq", "--gptaq-alpha", "1"], None, ["--gar", "false", "--gptaq", "1"]),
    "gptaq-gar": Method(["--method", "gptq", "--gptaq", "--act-group-aware"], None, ["--gar", "true", "--gptaq", "0.25"]),
    # GPTAQ with every Hessian from one float run of the layer (GPTQ's default; GPTAQ's is true-sequential)
    "gptaq-nots": Method(["--method", "gptq", "--gptaq", "--no-true-sequential"], None),
    # GPTQModel's GPTQ with its act_group_aware off: plain GPTQ, as quantkit's and llm-compressor's `gptq`
    "gptq-nogar": Method(None, None, ["--gar", "false"]),
}
