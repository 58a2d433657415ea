"""quantkit's engine against vLLM's CPU build, same model, prompts and threads, alternating rounds.

  python -m quantkit.bench.engine --against-vllm VENV [--threads 2] [--rounds 3] [--dtype auto] [--gptq]

Workloads (token-id prompts, greedy, EOS ignored):
  (a) 64 prompts x 128 tokens in, 128 out
  (b) 32 prompts sharing a 512-token prefix + 32 own tokens, 32 out
  (c) one request, 128 in, 128 out
Model: a random Llama (hidden 1024, intermediate 2816, 8 layers, 16 heads, 8 KV heads, vocab 32000);
with --gptq, its 4-bit RTN checkpoint in the GPTQ v1 layout (symmetric, group 128), which vLLM reads.
vLLM runs in a subprocess of VENV's python (quantkit/bench/vllm_worker.py) with
VLLM_CPU_OMP_THREADS_BIND covering the same number of cores. Per round and workload: ours, then vLLM.
TTFT is the wall time of the same prompts with max_tokens=1 (one definition for both systems).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int


def workloads(vocab: int = 32000) -> list[Workload]:
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    prefix = ids(512)
    return [Workload("a", [ids(128) for _ in range(64)], 128),
            Workload("b", [prefix + ids(32) for _ in range(32)], 32),
            Workload("c", [ids(128)], 128)]


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


@dataclass
class Tally:
    tok_s: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)

    def line(self) -> str:
        return f"{statistics.median(self.tok_s):8.1f} tok/s  TTFT {statistics.median(self.ttft) * 1e3:8.1f} ms"


class Ours:
    def __init__(self, model: Path, dtype: str, threads: int):
        from quantkit.engine import LLM

        t = time.perf_counter()
        self.llm = LLM(str(model), dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=64, num_threads=threads)
        self.startup = time.perf_counter() - t

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        from quantkit.engine import SamplingParams

        t = time.perf_counter()
        outs = self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


class VLLM:
    """vLLM in a subprocess of its own venv, fed one JSON job per line."""

    def __init__(self, venv: Path, model: Path, dtype: str, threads: int, log: Path):
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="2",
                   HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        args = json.dumps(dict(model=str(model), dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=64))
        self.log = log.resolve()
        log.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        self.proc = subprocess.Popen([str(venv / "bin" / "python"), str(Path(__file__).with_name("vllm_worker.py")),
                                      args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                     env=env, text=True, cwd=model.parent)  # not the repo root: its
        # kernels/ folder would shadow a `kernels` package vLLM imports
        if "ready" not in self._answer():
            raise RuntimeError(f"vLLM did not start; see {log}")
        self.startup = time.perf_counter() - t

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"vLLM exited; see {self.log}")

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        self.proc.stdin.write(json.dumps(dict(prompts=prompts, max_tokens=max_tokens)) + "\n")
        self.proc.stdin.flush()
        a = self._answer()
        return a["seconds"], a["tokens"]

    def kernels(self) -> list[str]:
        """vLLM's log lines that name the linear kernels it picked."""
        return sorted({line.strip()[-160:] for line in self.log.read_text().splitlines() if "Kernel" in line})

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def measure(system, w: Workload, tally: Tally) -> None:
    seconds, tokens = system.run(w.prompts, w.max_tokens)
    tally.tok_s.append(tokens / seconds)
    tally.ttft.append(system.run(w.prompts, 1)[0])


def compare(model: Path, label: str, args) -> None:
    from quantkit.devices import auto_cpu_dtype
    from quantkit.engine.weights import WeightMemory

    dtype = auto_cpu_dtype()[0] if args.dtype == "auto" else args.dtype
    ours = Ours(model, dtype, args.threads)
    systems = {"quantkit": ours}
    try:
        systems["vLLM"] = VLLM(Path(args.against_vllm).resolve(), model, dtype, args.threads, Path(args.vllm_log))
    except RuntimeError as e:
        print(f"vLLM did not run this model in {dtype}: {e}")
    loads = [os.getloadavg()[0]]
    wls = [w for w in workloads() if w.name in args.workloads.split(",")]
    for w in wls:  # warm-up, not counted
        for system in systems.values():
            system.run(w.prompts[:2], 2)
    tallies = {(w.name, s): Tally() for w in wls for s in systems}
    for _ in range(args.rounds):
        for w in wls:
            for name, system in systems.items():
                measure(system, w, tallies[w.name, name])
        loads.append(os.getloadavg()[0])
    print(f"\n== {label}, {dtype}, {args.threads} threads, median of {args.rounds} alternating rounds; "
          f"load average {min(loads):.1f}-{max(loads):.1f}; start-up: "
          + ", ".join(f"{n} {s.startup:.1f} s" for n, s in systems.items()))
    print(f"quantkit {WeightMemory.of(ours.llm.engine.model).describe()}")
    for w in wls:
        line = " | ".join(f"{n} {tallies[w.name, n].line()}" for n in systems)
        if "vLLM" in systems:
            o, v = tallies[w.name, "quantkit"], tallies[w.name, "vLLM"]
            line += (f" | tok/s ratio {statistics.median(o.tok_s) / statistics.median(v.tok_s):.2f}x, "
                     f"TTFT ratio {statistics.median(o.ttft) / statistics.median(v.ttft):.2f}x")
        print(f"({w.name}) {line}", flush=True)
    if "vLLM" in systems:
        for line in systems["vLLM"].kernels():
            print(f"vLLM: {line}")
        systems["vLLM"].close()


def run(args) -> None:
    import tempfile

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        dense = make_dense(Path(tmp))
        if not args.gptq_only:
            compare(dense, "random Llama (hidden 1024, 8 layers), float", args)
        if args.gptq or args.gptq_only:
            compare(make_gptq(dense, Path(tmp)), "same model, 4-bit RTN in the GPTQ v1 layout (group 128)", args)
