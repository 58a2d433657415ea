"""Validated configuration objects, built once at the CLI edge and passed down."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantkit.devices import COMPUTE_DTYPES, check_device_name
from quantkit.errors import QuantkitError
from quantkit.format.primitives import QuantScheme

METHODS = ("rtn", "gptq", "awq")  # each built by quantkit.quant.pipeline.make_method
FORMATS = ("gptq", "awq", "compressed-tensors")
BITS = (4, 8)
GROUP_SIZES = (-1, 32, 64, 128)
AWQ_NEXT_INPUTS = ("quantized", "float")
# AWQ's scale formulas per smoothing group (quantkit.quant.awq_search.scale_candidates): activations only, with the
# weight statistic too (duo scaling), or both searched and the lower loss kept
DUO_SCALINGS = ("false", "true", "both")


@dataclass(frozen=True)
class ScaleSearch:
    """One way RTN and GPTQ choose each group's scale and zero (--scale-search; quantkit.quant.scale_search)."""

    searched: bool  # False: min-max
    # each input channel's error weighted by the calibration inputs' mean square ("measured": RTN then reads
    # --calib, GPTQ its Hessian's diagonal) or by an estimate of it read off the model's own weights ("estimated":
    # quantkit.quant.weight_prior, data-free); None: the plain weight error
    weighting: str | None = None
    methods: tuple[str, ...] = ("rtn", "gptq")

    @property
    def weighted(self) -> bool:
        return self.weighting is not None

    @property
    def measures_inputs(self) -> bool:
        return self.weighting == "measured"


SCALE_SEARCHES = {
    "minmax": ScaleSearch(searched=False),
    "mse": ScaleSearch(searched=True),
    "imatrix": ScaleSearch(searched=True, weighting="measured"),
    "prior": ScaleSearch(searched=True, weighting="estimated", methods=("rtn",)),  # GPTQ measures its inputs
}
# the data-free search a mode falls back to where its inputs are not measured (an MoE's experts under RTN)
DATA_FREE_FALLBACK = "mse"
GPTAQ_ALPHA = 0.25  # GPTAQ's reference code's and GPTQModel's share of the asymmetric correction (--gptaq-alpha)


@dataclass(frozen=True)
class CalibConfig:
    source: str = "wikitext2"  # a .txt/.jsonl file, a folder of them, or a recipe name
    nsamples: int = 128
    seqlen: int = 2048
    seed: int = 0

    def __post_init__(self):
        if self.nsamples < 1:
            raise QuantkitError(f"--nsamples must be at least 1 (got {self.nsamples})")
        if self.seqlen < 8:
            raise QuantkitError(f"--seqlen must be at least 8 (got {self.seqlen})")


def refuse_out_over_source(model: str, out: Path) -> None:
    """--out must not be the source folder, lie inside it, or hold it (symlinks resolved): writing
    there, with or without --force, would replace the float weights it is made from."""
    source = Path(model).expanduser()
    if not source.exists():
        return  # a hub id: downloaded into the hub cache, which --out cannot replace
    source, target = source.resolve(), Path(out).expanduser().resolve()
    where = ("is" if target == source else "is inside" if source in target.parents
             else "holds" if target in source.parents else None)
    if where is not None:
        raise QuantkitError(f"--out {out} {where} the source model folder {model}; "
                            f"write the quantized checkpoint elsewhere")


@dataclass(frozen=True)
class QuantizeConfig:
    model: str
    out: Path
    method: str = "gptq"
    format: str | None = None  # None: the method's natural layout (awq -> awq, else gptq)
    bits: int = 4
    group_size: int = 128
    sym: bool | None = None  # None: the method's default (gptq/rtn symmetric, awq asymmetric)
    desc_act: bool = False
    # GPTQ's group-aware act-order (GAR, GPTQModel's act_group_aware): groups by importance, g_idx stays monotonic
    act_group_aware: bool = False
    # GPTQ: each group's scale and zero from the original weights, fixed before the column loop (as
    # llm-compressor's observer does; measured at or below the lazy, updated-columns choice: docs/BENCHMARKS.md)
    static_groups: bool = True
    # GPTQ with asymmetric calibration (GPTAQ, GPTQModel's v2): each linear's target is the float model's output on
    # the float model's inputs, not its own weights on the quantized model's inputs (quantkit.quant.gptaq
    # asymmetric_target); gptaq_alpha scales that correction (1: the exact objective)
    gptaq: bool = False
    gptaq_alpha: float = GPTAQ_ALPHA
    damp: float = 0.01
    block_size: int = 128
    # GPTQ: False = every Hessian from one float run of the layer (measured better and faster); None: the method's
    # default, which is False but under GPTAQ True (its cross term then sees the layer's own earlier quantization
    # error, as GPTAQ's reference and GPTQModel run it: measured closer to float, docs/BENCHMARKS.md)
    true_sequential: bool | None = None
    calib: CalibConfig = field(default_factory=CalibConfig)
    device: str = "auto"
    # dtype of the calibration forward passes (auto: bf16 where the device computes it natively);
    # the quantizers' math and the weights they read stay fp32
    compute_dtype: str = "auto"
    # give freed memory back between layers (malloc_trim); the CLI's --low-memory also bounds the heap
    low_memory: bool = True
    force: bool = False
    dry_run: bool = False
    max_shard_size: int = 2 * 1024**3
    scale_search: str = "minmax"  # one of SCALE_SEARCHES (RTN and GPTQ)
    awq_duo_scaling: str = "false"  # one of DUO_SCALINGS (True / False, as older recipes write it, are read as "true" / "false")
    awq_grid: int = 20
    awq_row_gain: bool = True  # AWQ: each output row's scales times its least-squares gain on the calibration inputs
    awq_search_tokens: int = 2048  # AWQ's scale search judges candidates on evenly strided samples up to this many tokens (0: all)
    # AWQ: what feeds the next layer: the float layer's outputs (llm-awq, AutoAWQ, llm-compressor) or the quantized one's
    awq_next_inputs: str = "quantized"
    load_plan: Path | None = None
    quantize_lm_head: bool = False  # GPTQModel's lm_head=True: lm_head packed like the decoder linears (RTN)
    recipe: dict | None = None  # the --config recipe (name, path, description, values), recorded in the metadata
    strict: bool = False  # refuse what is otherwise a warning (too little calibration text)

    def __post_init__(self):
        if self.method not in METHODS:
            raise QuantkitError(f"unknown method {self.method!r}; expected one of {', '.join(METHODS)}")
        if self.format is not None and self.format not in FORMATS:
            raise QuantkitError(f"unknown format {self.format!r}; expected one of {', '.join(FORMATS)}")
        if self.bits not in BITS:
            raise QuantkitError(f"unsupported --bits {self.bits}; supported: 4, 8")
        if self.group_size not in GROUP_SIZES:
            raise QuantkitError(f"unsupported --group-size {self.group_size}; supported: 32, 64, 128, -1 (per channel)")
        if not 0 < self.damp < 1:
            raise QuantkitError(f"--damp must be in (0, 1) (got {self.damp})")
        if self.block_size < 1 or (self.group_size != -1 and self.block_size % self.group_size):
            raise QuantkitError(f"--block-size {self.block_size} must be a multiple of the group size")
        if self.layout_format == "awq" and self.bits != 4:
            raise QuantkitError("the AWQ format holds 4-bit weights only")
        if self.layout_format == "awq" and self.desc_act:
            raise QuantkitError("--desc-act (act-order) cannot be written in the AWQ format, which has no g_idx; "
                                "use --format gptq")
        if self.desc_act and self.method != "gptq":
            raise QuantkitError("--desc-act applies to --method gptq only")
        if self.act_group_aware and self.method != "gptq":
            raise QuantkitError("--act-group-aware applies to --method gptq only")
        if self.act_group_aware and self.desc_act:
            raise QuantkitError("--act-group-aware and --desc-act are two column orders for GPTQ; choose one")
        if self.gptaq and self.method != "gptq":
            raise QuantkitError("--gptaq applies to --method gptq only")
        if self.true_sequential is None:
            object.__setattr__(self, "true_sequential", self.gptaq)
        if not 0 < self.gptaq_alpha <= 1:
            raise QuantkitError(f"--gptaq-alpha must be in (0, 1] (got {self.gptaq_alpha})")
        if self.gptaq_alpha != GPTAQ_ALPHA and not self.gptaq:
            raise QuantkitError("--gptaq-alpha applies with --gptaq only")
        if self.desc_act and self.layout_format == "compressed-tensors":
            # compressed-tensors >= 0.20 stores act-order only as "weight" ordering: groups on the original columns
            object.__setattr__(self, "static_groups", True)
        if isinstance(self.awq_duo_scaling, bool):
            object.__setattr__(self, "awq_duo_scaling", str(self.awq_duo_scaling).lower())
        if self.awq_duo_scaling not in DUO_SCALINGS:
            raise QuantkitError(f"unknown --awq-duo-scaling {self.awq_duo_scaling!r}; expected one of {', '.join(DUO_SCALINGS)}")
        if self.scale_search not in SCALE_SEARCHES:
            raise QuantkitError(f"unknown --scale-search {self.scale_search!r}; expected one of {', '.join(SCALE_SEARCHES)}")
        if self.method not in self.search.methods and self.search.searched:
            clip = " (AWQ searches its own clip)" if self.method == "awq" else ""
            hint = " (GPTQ measures its inputs: use imatrix)" if self.method == "gptq" else ""
            raise QuantkitError(f"--scale-search {self.scale_search} applies to --method "
                                f"{' and '.join(self.search.methods)}{clip}{hint}")
        if self.awq_next_inputs not in AWQ_NEXT_INPUTS:
            raise QuantkitError(f"unknown --awq-next-inputs {self.awq_next_inputs!r}; expected one of {', '.join(AWQ_NEXT_INPUTS)}")
        if self.load_plan is not None and self.method != "awq":
            raise QuantkitError("--load-plan applies to --method awq only")
        if self.quantize_lm_head and self.layout_format != "gptq":
            raise QuantkitError("--quantize-lm-head is written in the GPTQ layout only (quantization_config lm_head, "
                                "as GPTQModel and vLLM read it); use --format gptq")
        check_device_name(self.device)
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise QuantkitError(f"unknown --compute-dtype {self.compute_dtype!r}; expected one of {', '.join(COMPUTE_DTYPES)}")
        refuse_out_over_source(self.model, self.out)

    @property
    def search(self) -> ScaleSearch:
        """What --scale-search does (SCALE_SEARCHES)."""
        return SCALE_SEARCHES[self.scale_search]

    @property
    def awq_weight_statistic(self) -> bool:
        """Whether AWQ's scale search needs the weight statistic (duo scaling "true" or "both")."""
        return self.awq_duo_scaling != "false"

    @property
    def layout_format(self) -> str:
        return self.format or ("awq" if self.method == "awq" else "gptq")

    @property
    def is_sym(self) -> bool:
        return (self.method != "awq") if self.sym is None else self.sym

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(bits=self.bits, group_size=self.group_size, sym=self.is_sym)

    @property
    def layout(self) -> str:
        """On-disk layout: awq, compressed-tensors (pack-quantized), gptq (v1, symmetric) or gptq_v2
        (asymmetric, since v1 stores zero - 1)."""
        if self.layout_format in ("awq", "compressed-tensors"):
            return self.layout_format
        return "gptq" if self.is_sym else "gptq_v2"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out"] = str(self.out)
        d["load_plan"] = None if self.load_plan is None else str(self.load_plan)
        d["sym"] = self.is_sym
        d["format"] = self.layout_format
        d["layout"] = self.layout
        return d
