"""quantkit's engine against vLLM's CPU build, same model, prompts and threads, alternating rounds.

  quantkit bench engine [MODEL] [--against-vllm VENV] [--threads 2] [--rounds 3] [--workloads a,b,c] [--gptq]
  python -m quantkit.bench.engine --against-vllm VENV [--threads 2] [--rounds 3] [--dtype auto] [--gptq]

Workloads (token-id prompts, greedy, EOS ignored):
  (a) 64 prompts x 128 tokens in, 128 out
  (b) 32 prompts sharing a 512-token prefix + 32 own tokens, 32 out
  (c) one request, 128 in, 128 out
  (d8), (d32) decode throughput at 8 and 32 concurrent sequences: that many prompts x 128 tokens in, 128 out, fresh
       random prompts each run (no prefix cache helps); decode tok/s = the tokens after each sequence's first /
       (wall time of the run - wall time of a max_tokens=1 run on as many other fresh prompts)
Model: MODEL, or the embedded benchmark model: a random Llama (hidden 1024, intermediate 2816, 8 layers, 16 heads,
8 KV heads, vocab 32000); with --gptq, also its 4-bit RTN checkpoint in the GPTQ v1 layout (symmetric, group 128),
which vLLM reads. vLLM runs in a subprocess of VENV's python (quantkit/bench/vllm_process.py) with
VLLM_CPU_OMP_THREADS_BIND covering the same number of cores; idle, its worker spins (the report says how many cores),
so it is stopped (SIGSTOP) between its jobs. Per round and workload both systems run, in alternating order.
TTFT is the wall time of the same prompts with max_tokens=1 (one definition for both systems). Resident memory of
each engine's process after load and at the end (quantkit's: this process, which also holds the benchmark).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.bench.engine_report import Comparison, WorkloadResult
from quantkit.bench.rounds import round_order
from quantkit.progress import Bar

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
MAX_MODEL_LEN = 1024
WORKLOADS = ("a", "b", "c", "d8", "d32")
DTYPES = ("auto", "bfloat16", "float32")


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int
    vocab: int = 32000
    fresh: bool = False  # decode throughput: fresh prompts each run, and the decode rate reported

    @property
    def tokens_needed(self) -> int:
        """The longest sequence it makes: its longest prompt and all its new tokens."""
        return max(len(p) for p in self.prompts) + self.max_tokens


def workloads(vocab: int = 32000) -> list[Workload]:
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    prefix = ids(512)
    return [Workload("a", [ids(128) for _ in range(64)], 128),
            Workload("b", [prefix + ids(32) for _ in range(32)], 32),
            Workload("c", [ids(128)], 128),
            *(Workload(f"d{n}", [ids(128) for _ in range(n)], 128, vocab, fresh=True) for n in (8, 32))]


def fresh_prompts(w: Workload, seed: int) -> list[list[int]]:
    """Prompts of `w`'s lengths, random ids from `seed`: ones no earlier run has cached."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, w.vocab, (len(p),), generator=g).tolist() for p in w.prompts]


@dataclass(frozen=True)
class EngineBenchConfig:
    """One run of the comparison, validated where it is built (the CLI edge): `model` None is the embedded benchmark
    model, built in a temporary folder (`gptq`: also its 4-bit checkpoint; `gptq_only`: only that)."""

    model: Path | None = None
    vllm_venv: Path | None = None
    threads: int = 2
    rounds: int = 3
    workloads: tuple[str, ...] = WORKLOADS
    dtype: str = "auto"
    gptq: bool = False
    gptq_only: bool = False
    vllm_log: Path = Path("out/vllm-bench.log")
    cpu_int8_activations: bool = False  # quantkit's 4-bit linears W4A8 (EngineConfig.cpu_int8_activations)

    def __post_init__(self) -> None:
        from quantkit.errors import QuantkitError

        if not self.workloads or any(w not in WORKLOADS for w in self.workloads) \
                or len(set(self.workloads)) != len(self.workloads):
            raise QuantkitError(f"--workloads: {','.join(self.workloads) or '(none)'}: a comma-separated list of "
                                f"distinct names from {', '.join(WORKLOADS)}")
        if self.threads < 1 or self.rounds < 1:
            raise QuantkitError("--threads and --rounds must be at least 1")
        if self.dtype not in DTYPES:
            raise QuantkitError(f"--dtype: {self.dtype}: one of {', '.join(DTYPES)}")
        if self.model is not None and (self.gptq or self.gptq_only):
            raise QuantkitError("--gptq and --gptq-only make the embedded model's 4-bit checkpoint; with MODEL, "
                                "pass a 4-bit checkpoint as MODEL instead")
        if self.vllm_venv is not None and not (self.vllm_venv / "bin" / "python").is_file():
            raise QuantkitError(f"--against-vllm: {self.vllm_venv}: no bin/python in it (a venv with vLLM's CPU build)")
        if self.model is not None:
            if not (self.model / "config.json").is_file():
                raise QuantkitError(f"{self.model}: not a checkpoint folder (no config.json)")
            workloads_for(self.model, self.workloads)  # each must fit the model's context


def model_limits(model: Path) -> tuple[int, int]:
    """(vocab size, the context this comparison gives both engines) of the checkpoint at `model`."""
    from quantkit.model.checkpoint import read_config

    config = read_config(model)
    config = config.get("text_config", config)
    return int(config["vocab_size"]), min(MAX_MODEL_LEN, int(config.get("max_position_embeddings", MAX_MODEL_LEN)))


def workloads_for(model: Path, names: tuple[str, ...]) -> tuple[list[Workload], int]:
    """The named workloads with token ids of `model`'s vocabulary, and the context length they run at. Raises a
    one-line QuantkitError where a workload does not fit the model's context."""
    from quantkit.errors import QuantkitError

    vocab, max_len = model_limits(model)
    chosen = [w for w in workloads(vocab) if w.name in names]
    for w in chosen:
        if w.tokens_needed > max_len:
            raise QuantkitError(f"workload ({w.name}) makes sequences of {w.tokens_needed} tokens; {model} holds "
                                f"{max_len} (--workloads without {w.name})")
    return chosen, max_len


def make_dense(out: Path) -> Path:
    """The random Llama in bf16 safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.calibration.synthetic import build_tokenizer

    torch.manual_seed(0)
    dense = out / "bf16"
    model = LlamaForCausalLM(LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **SHAPE))
    model.to(torch.bfloat16).save_pretrained(dense)
    build_tokenizer(vocab_size=512).save_pretrained(dense)
    return dense


def make_gptq(dense: Path, out: Path, lm_head: bool = False) -> Path:
    """`dense` quantized: RTN, 4-bit, symmetric, group 128, GPTQ v1 layout (lm_head too with `lm_head`)."""
    from quantkit.calibration.synthetic import make_corpus
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.quant.pipeline import quantize_model

    calib = out / "calib.txt"
    calib.write_text("\n\n".join(make_corpus(16, seed=1)))
    q = out / ("gptq-lm-head" if lm_head else "gptq")
    q.mkdir()
    cfg = QuantizeConfig(model=str(dense), out=q, method="rtn", format="gptq", bits=4, group_size=128, sym=True,
                         calib=CalibConfig(source=str(calib), nsamples=4, seqlen=64), device="cpu",
                         quantize_lm_head=lm_head)
    quantize_model(cfg, out_dir=q, show_progress=False)
    return q


class Ours:
    def __init__(self, model: Path, dtype: str, threads: int, max_model_len: int = MAX_MODEL_LEN,
                 int8_activations: bool = False):
        from quantkit.engine import LLM

        t = time.perf_counter()
        self.llm = LLM(str(model), dtype=dtype, max_model_len=max_model_len, max_num_seqs=64, num_threads=threads,
                       cpu_int8_activations=int8_activations)
        self.startup = time.perf_counter() - t

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        from quantkit.engine import SamplingParams

        t = time.perf_counter()
        outs = self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def measure(system, w: Workload, result: WorkloadResult, name: str, r: int = 0) -> None:
    """One run of `w` on `system`: output tok/s, then TTFT (max_tokens 1); for a fresh-prompt workload, each on its
    own fresh prompts (round `r`'s), and the decode rate from the two."""
    full, first = (fresh_prompts(w, 2 * r + 1), fresh_prompts(w, 2 * r + 2)) if w.fresh else (w.prompts, w.prompts)
    seconds, tokens = system.run(full, w.max_tokens)
    result.tokens.setdefault(name, []).append(tokens)
    result.tok_s.setdefault(name, []).append(tokens / seconds)
    ttft = system.run(first, 1)[0]
    result.ttft_s.setdefault(name, []).append(ttft)
    if w.fresh:
        result.decode_tok_s.setdefault(name, []).append((tokens - len(full)) / (seconds - ttft))


@dataclass
class Contest:
    """The systems of one comparison and their results so far; vLLM leaves it where it fails mid-run (a model its CPU
    build cannot run), taking its figures and leaving its error."""

    systems: dict
    results: dict[str, WorkloadResult]
    vllm_error: str | None = None

    def attempt(self, name: str, job) -> None:
        """job(system) on system `name`, if it is still in."""
        if name not in self.systems:
            return
        try:
            job(self.systems[name])
        except RuntimeError as e:
            if name != "vLLM":
                raise
            self.vllm_error = str(e)
            self.systems.pop("vLLM").close()
            for r in self.results.values():
                for per_system in (r.tok_s, r.ttft_s, r.tokens, r.decode_tok_s):
                    per_system.pop("vLLM", None)

    def rounds(self, wls: list[Workload], names: list[str], rounds: int, label: str, bar: Bar) -> list[float]:
        """A warm-up, then `rounds` alternating rounds; the load average at the start and after each round."""
        loads = [os.getloadavg()[0]]
        bar.describe(f"{label}: warm-up")
        for w in wls:  # not counted
            for name in names:
                self.attempt(name, lambda s: s.run(w.prompts[:2], 2))
        for i in range(rounds):
            for w in wls:
                for name in round_order(names, i):
                    bar.describe(f"{label}: round {i + 1} of {rounds}, ({w.name}) on {name}")
                    self.attempt(name, lambda s: measure(s, w, self.results[w.name], name, i))
                    bar()
            loads.append(os.getloadavg()[0])
        return loads


def compare(model: Path, label: str, cfg: EngineBenchConfig, bar: Bar | None = None) -> Comparison:
    """`model` on quantkit's engine and, with `cfg.vllm_venv`, on vLLM, alternating rounds; `bar` advances after each
    measured workload of each system and names the part under way."""
    from quantkit.bench.peak_rss import rss_bytes
    from quantkit.bench.vllm_process import VLLM
    from quantkit.devices import auto_cpu_dtype
    from quantkit.engine.weights import WeightMemory

    bar = bar or Bar()
    dtype = auto_cpu_dtype()[0] if cfg.dtype == "auto" else cfg.dtype
    wls, max_len = workloads_for(model, cfg.workloads)
    bar.describe(f"{label}: loading in quantkit")
    ours = Ours(model, dtype, cfg.threads, max_len, cfg.cpu_int8_activations)
    contest = Contest({"quantkit": ours}, {w.name: WorkloadResult(w.name) for w in wls})
    startup, rss, idle = {"quantkit": ours.startup}, {"quantkit": rss_bytes()}, None
    if cfg.vllm_venv is not None:
        bar.describe(f"{label}: starting vLLM")
        try:
            vllm = VLLM(cfg.vllm_venv.resolve(), model, dtype, cfg.threads, cfg.vllm_log, max_len, pause_idle=True)
            contest.systems["vLLM"], startup["vLLM"], rss["vLLM"] = vllm, vllm.startup, vllm.rss()
        except RuntimeError as e:
            contest.vllm_error = str(e)
    names = ["quantkit"] + (["vLLM"] if cfg.vllm_venv is not None else [])  # what the progress bar counts
    try:
        loads = contest.rounds(wls, names, cfg.rounds, label, bar)
        kernels = contest.systems["vLLM"].kernels() if "vLLM" in contest.systems else []
        ends = {"quantkit": rss_bytes()}
        if "vLLM" in contest.systems:
            ends["vLLM"], idle = contest.systems["vLLM"].rss(), contest.systems["vLLM"].idle_cores()
    finally:
        if "vLLM" in contest.systems:
            contest.systems["vLLM"].close()
    kv = {"quantkit": ours.llm.engine.kv_plan.describe().removeprefix("KV cache: "),
          "vLLM": "2 GiB pool (VLLM_CPU_KVCACHE_SPACE=2)"}
    return Comparison(label, str(model), dtype, cfg.threads, cfg.rounds, (min(loads), max(loads)),
                      startup, WeightMemory.of(ours.llm.engine.model).describe(),
                      list(contest.results.values()), kernels, contest.vllm_error,
                      {n: (rss[n], ends[n]) for n in ends}, kv, idle)


def comparisons(cfg: EngineBenchConfig, bar: Bar | None = None) -> list[Comparison]:
    """cfg's model, or the embedded benchmark model (and its 4-bit checkpoint with --gptq), compared."""
    import tempfile

    bar = bar or Bar()
    torch.set_num_threads(cfg.threads)
    if cfg.model is not None:
        return [compare(cfg.model, cfg.model.name, cfg, bar)]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        bar.describe("making the benchmark model")
        dense = make_dense(Path(tmp))
        if not cfg.gptq_only:
            out.append(compare(dense, "random Llama (hidden 1024, 8 layers), float", cfg, bar))
        if cfg.gptq or cfg.gptq_only:
            bar.describe("quantizing it to 4 bits")
            out.append(compare(make_gptq(dense, Path(tmp)), "same model, 4-bit RTN in the GPTQ v1 layout (group 128)",
                               cfg, bar))
    return out


def measurements(cfg: EngineBenchConfig) -> int:
    """How many times `comparisons(cfg)` advances its bar: the bar's total."""
    models = 1 if cfg.model is not None else int(not cfg.gptq_only) + int(cfg.gptq or cfg.gptq_only)
    return models * cfg.rounds * len(cfg.workloads) * (2 if cfg.vllm_venv is not None else 1)


def run(args) -> None:
    """`python -m quantkit.bench.engine --against-vllm VENV ...`: the embedded model, a plain-text report."""
    from quantkit.errors import QuantkitError

    try:
        cfg = EngineBenchConfig(vllm_venv=Path(args.against_vllm), threads=args.threads, rounds=args.rounds,
                                workloads=tuple(args.workloads.split(",")), dtype=args.dtype, gptq=args.gptq,
                                gptq_only=args.gptq_only, vllm_log=Path(args.vllm_log))
    except QuantkitError as exc:
        raise SystemExit(f"error: {exc}") from None
    for c in comparisons(cfg):
        print("\n".join(c.lines()), flush=True)
