"""quantkit's engine against llama.cpp (llama-cpp-python) at batch 1: same model, prompt and threads, one sitting.

  python -m quantkit.bench.vs_llamacpp --llamacpp-venv VENV [--threads 2] [--rounds 3] [--quants Q4_0,Q4_K_M]
                                       [--model DIR --gptq DIR] [--gguf-dir DIR] [--quantized-only] [--int8-activations [only]]
                                       [--bound]
  python -m quantkit.bench.vs_llamacpp --llamacpp-venv VENV --ttft 512,2048 [--bf16] [--w4a16] [--int8-activations]
                                       [--vllm-venv VENV] ...

Model: the random Llama of the engine-vs-vLLM benchmark (hidden 1024, intermediate 2816, 8 layers,
16 heads, 8 KV heads, vocab 32000, bf16 safetensors) and its 4-bit checkpoint (RTN, symmetric,
group 128, GPTQ v1 layout: what `quantkit quantize --method rtn --format gptq` writes; and the same with
lm_head packed, `--quantize-lm-head`), or the ones given.
llama.cpp gets the same float model as an F32 GGUF (quantkit.bench.gguf_export; bf16 values are exact
in F32), quantized by llama.cpp's own `llama_model_quantize` to each of --quants.
Workload: one request, 128 prompt tokens (workload (c) of the vLLM benchmark), 128 new tokens, greedy,
EOS ignored. Prompt processing tok/s = 128 / time to first token; decode tok/s = the other 127 tokens /
their time. Per round every system runs once, in the same order; medians of --rounds are printed
with llama.cpp's and quantkit's ratios.
llama.cpp runs in a subprocess of VENV's python (quantkit/bench/llamacpp_worker.py) started outside
the repo root, with n_threads = n_threads_batch = --threads. Conversion check: llama.cpp F32's greedy
tokens against quantkit fp32's, and its logits after the prompt against transformers' fp32 logits.
--gguf-dir keeps the GGUFs (4.7 GB F32 at the 1B shape) for the next run of the same --model.
--quantized-only (8B shapes): only the 4-bit systems, no float rows or conversion check, llama.cpp's types quantized
from a streamed F16 GGUF rather than an F32 one.
--bound: after each round, the machine's read bandwidth of that moment (the fastest of the streaming kernel at each
prefetch distance and torch's sum, quantkit.bench.real_shapes.best_read), and each system's decode in that round as
a fraction of bandwidth / bytes its token reads (quantkit: every resident weight but the untied embedding table;
llama.cpp: the GGUF's tensors but token_embd where output.weight exists): the host's bandwidth drifts from minute to
minute, so each round is held against its own.

--ttft: the time-to-first-token table instead. Batch 1, one fresh random prompt of each length a round (no prefix
cache can answer it), max_tokens 1, every system once a round in alternating order: quantkit's engine on the 4-bit
checkpoint (wall time of `generate`; with --int8-activations also in W4A8, with --bf16 also the float model),
llama.cpp on each of --quants (one worker each; its own timing of the prompt's evaluation and argmax), vLLM's CPU
build on the same 4-bit checkpoint with --vllm-venv (its worker's timing of `generate`; stopped between its jobs,
since idle it spins). Resident memory of each process after load and at the end; quantkit and llama.cpp hold the same
KV cache (context = longest prompt + 64, 16-bit), vLLM its least pool, 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.bench.gguf_export import gguf_read_per_token
from quantkit.bench.llamacpp_process import WORKER, WorkerProcess, peer_env

MiB = 1024**2
PROMPT_LEN, NEW_TOKENS, N_CTX = 128, 128, 512


@dataclass
class Run:
    prefill_s: float
    decode_s: float
    tokens: list[int]
    first_logits: list[float] | None = None


@dataclass
class Tally:
    prefill: list[float] = field(default_factory=list)  # prompt tok/s
    decode: list[float] = field(default_factory=list)  # decode tok/s

    def add(self, run: Run) -> None:
        self.prefill.append(PROMPT_LEN / run.prefill_s)
        self.decode.append((len(run.tokens) - 1) / run.decode_s)

    def medians(self) -> tuple[float, float]:
        return statistics.median(self.decode), statistics.median(self.prefill)


class Quantkit:
    """quantkit's engine, one sequence at a time. Its prefix cache is off: every round feeds the same prompt, and a
    cached prefix would time a few tokens' prefill as the whole prompt's (llama.cpp's worker evaluates it whole)."""

    def __init__(self, model: Path, dtype: str, threads: int, int8_activations: bool = False, n_ctx: int = N_CTX,
                 kv_cache_memory: int | None = None, int8_prefill: bool | None = None):
        from quantkit.engine import LLM
        from quantkit.engine.weights import WeightMemory

        self.llm = LLM(str(model), dtype=dtype, max_model_len=n_ctx, max_num_seqs=1, num_threads=threads,
                       cpu_int8_activations=int8_activations, cpu_int8_prefill=int8_prefill,
                       kv_cache_memory=kv_cache_memory,
                       enable_prefix_caching=False)
        weights = WeightMemory.of(self.llm.engine.model)
        self.kernel, self.read_per_token = weights.describe(), weights.read_per_token

    def run(self, prompt: list[int], max_tokens: int) -> Run:
        from quantkit.engine import SamplingParams

        out = self.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
        m = out.metrics
        return Run(m.time_to_first_token, m.decode_time, list(out.outputs[0].token_ids))

    def first_token_s(self, prompt: list[int]) -> float:
        """Wall time of the prompt and its first token (max_tokens 1)."""
        from quantkit.engine import SamplingParams

        t = time.perf_counter()
        self.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        return time.perf_counter() - t


def llamacpp_speculation(python: Path, gguf: Path, workloads: dict, threads: int, k: int, ngram: int,
                         max_tokens: int, rounds: int) -> dict:
    """llama-cpp-python's own n-gram speculation against none on `gguf` (llamacpp_worker.py speculate):
    {workload: {"plain": [tok/s a round], "spec": [...], "same": bool}}; `workloads`: {name: {"prompts": [[ids]],
    "temperature": t}}."""
    job = {"model": str(gguf), "threads": threads, "n_ctx": 512, "k": k, "ngram": ngram, "max_tokens": max_tokens,
           "rounds": rounds, "workloads": workloads}
    proc = subprocess.run([str(python), str(WORKER), "speculate", json.dumps(job)], capture_output=True, text=True,
                          cwd=gguf.parent, env=peer_env())
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp speculation failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llamacpp_quantize(python: Path, src: Path, dst: Path, kind: str, threads: int) -> float:
    """llama.cpp's quantizer in the peer venv; returns its seconds."""
    proc = subprocess.run([str(python), str(WORKER), "quantize", str(src), str(dst), kind, str(threads)],
                          capture_output=True, text=True, cwd=src.parent, env=peer_env())
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp quantize to {kind} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


class LlamaCpp:
    """llama-cpp-python in a subprocess of its venv, all models loaded once, one sequence at a time."""

    def __init__(self, python: Path, models: dict[str, Path], threads: int, log: Path, n_ctx: int = N_CTX):
        args = dict(models={k: str(v) for k, v in models.items()}, threads=threads, n_ctx=n_ctx)
        self.worker = WorkerProcess(python, "serve", args, next(iter(models.values())).parent, log)
        self.system_info, self.version = self.worker.system_info, self.worker.version

    def run(self, model: str, prompt: list[int], max_tokens: int, logits: bool = False) -> Run:
        a = self.worker.ask(dict(model=model, prompt=prompt, max_tokens=max_tokens, logits=logits))
        return Run(a["prefill_s"], a["decode_s"], a["tokens"], a["first_logits"])

    def close(self) -> None:
        self.worker.close()


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def transformers_logits(model: Path, prompt: list[int]) -> torch.Tensor:
    """fp32 logits after the prompt: [vocab]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1]


def conversion_check(model: Path, prompt: list[int], ours_fp32: Quantkit, peer: LlamaCpp) -> str:
    """llama.cpp F32 against quantkit fp32 (greedy tokens) and transformers fp32 (logits after the prompt)."""
    theirs = peer.run("F32", prompt, NEW_TOKENS, logits=True)
    ours = ours_fp32.run(prompt, NEW_TOKENS)
    ref = transformers_logits(model, prompt)
    diff = (torch.tensor(theirs.first_logits) - ref).abs().max().item()
    return (f"conversion check: llama.cpp F32 and quantkit fp32 agree on the first "
            f"{common_prefix(theirs.tokens, ours.tokens)} of {NEW_TOKENS} greedy tokens; logits after the prompt "
            f"vs transformers fp32: max |diff| {diff:.2e} (logit std {ref.std().item():.2f}), argmax "
            f"{'equal' if int(ref.argmax()) == theirs.tokens[0] else 'DIFFERENT'}")


def prepare(args, tmp: Path) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    """(float model, {label: 4-bit checkpoint}, {llama.cpp name: GGUF path}) in `tmp`. The random model's
    4-bit checkpoints: linears only, and lm_head packed too (`--quantize-lm-head`; llama.cpp's Q4 types
    quantize the output layer as well, to Q6_K)."""
    from quantkit.bench.engine_vs_vllm import make_dense, make_gptq
    from quantkit.bench.gguf_export import write_gguf

    dense = Path(args.model) if args.model else make_dense(tmp)
    if args.gptq:
        gptq = {"4-bit GPTQ": Path(args.gptq)}
    else:
        gptq = {"4-bit GPTQ": make_gptq(dense, tmp), "4-bit GPTQ + 4-bit lm_head": make_gptq(dense, tmp, lm_head=True)}
    python = Path(args.llamacpp_venv) / "bin" / "python"
    where = Path(args.gguf_dir) if args.gguf_dir else tmp
    where.mkdir(parents=True, exist_ok=True)
    base = "F16" if args.quantized_only else "F32"  # an 8B model's F32 file would be 32 GB
    ggufs = {base: where / f"model-{base.lower()}.gguf"}
    needed = [k for k in filter(None, args.quants.split(",")) if not (where / f"model-{k.lower()}.gguf").is_file()]
    if not ggufs[base].is_file() and (needed or not args.quantized_only):
        write_gguf(dense, ggufs[base], base.lower())
    for kind in filter(None, args.quants.split(",")):
        ggufs[kind] = where / f"model-{kind.lower()}.gguf"
        if ggufs[kind].is_file():  # --gguf-dir: made by an earlier run from the same --model
            continue
        part = ggufs[kind].with_suffix(".part")
        seconds = llamacpp_quantize(python, ggufs[base], part, kind, args.threads)
        part.rename(ggufs[kind])
        print(f"llama.cpp quantized {base} -> {kind} in {seconds:.2f} s ({ggufs[kind].stat().st_size / 1024**2:.1f} "
              f"MiB; {base} {ggufs[base].stat().st_size / 1024**2:.1f} MiB)")
    if args.quantized_only:  # the float file is only the quantizer's input
        del ggufs[base]
    return dense, gptq, ggufs


@dataclass(frozen=True)
class Arithmetic:
    """How a 4-bit quantkit system computes: its label's suffix and the engine's int8 settings."""

    suffix: str
    int8_activations: bool = False
    int8_prefill: bool | None = None  # None: the engine's default for this CPU


def activation_variants(args, auto: str) -> list[Arithmetic]:
    """The 4-bit quantkit systems to run: the engine's default arithmetic (prompt tokens W4A8, generated ones W4A16,
    where the CPU's W4A8 kernel for `auto` builds, and in bf16 no AMX tiles run prefill), with --w4a16 also W4A16
    throughout, with --int8-activations also W4A8 throughout (activations in int8, as llama.cpp's Q4 types); W4A8
    alone with `--int8-activations only`."""
    import torch

    from quantkit.kernels.linear_choice import prompt_q8_not_default

    prompts = "W4A8 prompts" if prompt_q8_not_default(getattr(torch, auto)) is None else "W4A16"
    tag = "" if auto == "bfloat16" else f"{auto}, "
    default, w4a16, w4a8 = Arithmetic(f"{tag}default: {prompts}"), Arithmetic(f"{tag}W4A16", int8_prefill=False), \
        Arithmetic(f"{tag}W4A8", True)
    if args.int8_activations == "only":
        return [w4a8]
    return [default] + ([w4a16] if args.w4a16 else []) + ([w4a8] if args.int8_activations else [])


def compare(args, tmp: Path) -> None:
    from quantkit.bench.engine_vs_vllm import workloads
    from quantkit.devices import auto_cpu_dtype

    dense, gptq, ggufs = prepare(args, tmp)
    vocab = json.loads((dense / "config.json").read_text())["vocab_size"]
    prompt = next(w for w in workloads(vocab) if w.name == "c").prompts[0]
    auto = auto_cpu_dtype()[0]  # float32 where bf16 would be emulated: then one float row
    ours = {} if args.quantized_only else {"quantkit fp32 (float model)": Quantkit(dense, "float32", args.threads)}
    if auto != "float32" and not args.quantized_only:
        ours[f"quantkit {auto} (float model)"] = Quantkit(dense, auto, args.threads)
    for label, path in gptq.items():
        for a in activation_variants(args, auto):
            ours[f"quantkit {label}, {a.suffix}"] = Quantkit(path, auto, args.threads, a.int8_activations,
                                                             int8_prefill=a.int8_prefill)
    peer = LlamaCpp(Path(args.llamacpp_venv) / "bin" / "python", ggufs, args.threads, Path(args.log).resolve())
    systems = {**{n: q.run for n, q in ours.items()},
               **{f"llama.cpp {k}": (lambda p, n, k=k: peer.run(k, p, n)) for k in ggufs}}
    if not args.quantized_only:
        print(conversion_check(dense, prompt, ours["quantkit fp32 (float model)"], peer))
    for run in systems.values():  # warm-up, not counted
        run(prompt[:16], 4)
    tallies = {n: Tally() for n in systems}
    bound = Bound({**{n: q.read_per_token for n, q in ours.items()},
                   **{f"llama.cpp {k}": gguf_read_per_token(p) for k, p in ggufs.items()}}) if args.bound else None
    loads = [os.getloadavg()[0]]
    for i in range(args.rounds):
        for name, run in systems.items():
            tallies[name].add(run(prompt, NEW_TOKENS))
        loads.append(os.getloadavg()[0])
        line = f" ({bound.measure(args.threads, tallies)})" if bound else ""
        print(f"round {i + 1}: " + ", ".join(f"{n} {t.decode[-1]:.1f}" for n, t in tallies.items())
              + f" decode tok/s; load {loads[-1]:.1f}{line}", flush=True)
    peer.close()
    report(args, tallies, loads, ours, peer)
    if bound:
        print(bound.report())


@dataclass
class Bound:
    """Each round's read bandwidth and each system's decode as a fraction of it (--bound)."""

    read_per_token: dict[str, int]  # bytes a decode token reads, by system
    gib: float = 2.0  # the read loops' buffer
    rates: list[tuple[float, str]] = field(default_factory=list)  # (bytes/s, loop) a round
    fractions: dict[str, list[float]] = field(default_factory=dict)

    def measure(self, threads: int, tallies: dict[str, Tally]) -> str:
        """The bound after a round; each system's last decode against it. A one-line summary."""
        from quantkit.bench.real_shapes import best_read

        rate, loop = best_read(threads, self.gib)
        self.rates.append((rate, loop))
        for name, t in tallies.items():
            self.fractions.setdefault(name, []).append(t.decode[-1] * self.read_per_token[name] / rate)
        return f"bound {rate / 1e9:.1f} GB/s, {loop}"

    def report(self) -> str:
        rates = [r for r, _ in self.rates]
        lines = [f"\n== against the bound: {min(rates) / 1e9:.1f}-{max(rates) / 1e9:.1f} GB/s over the rounds "
                 f"(the fastest loop of each round: {', '.join(sorted({loop for _, loop in self.rates}))})"]
        for name, f in self.fractions.items():
            lines.append(f"{name:46s} {self.read_per_token[name] / MiB:7.1f} MiB a token, decode at "
                         f"{statistics.median(f):.3g}x the bound (rounds {', '.join(f'{x:.3g}' for x in f)})")
        return "\n".join(lines)


def report(args, tallies: dict[str, Tally], loads: list[float], ours: dict, peer: LlamaCpp) -> None:
    print(f"\n== batch 1, {PROMPT_LEN} prompt tokens, {NEW_TOKENS} new (greedy, EOS ignored), {args.threads} threads, "
          f"median of {args.rounds} alternating rounds; load average {min(loads):.1f}-{max(loads):.1f}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for name, t in tallies.items():
        decode, prefill = t.medians()
        print(f"{name:46s} decode {decode:7.1f} tok/s (range {min(t.decode):.1f}-{max(t.decode):.1f})   "
              f"prompt {prefill:8.1f} tok/s")
    for name, q in ours.items():
        print(f"{name}: {q.kernel}")
    print(f"llama.cpp {peer.version}: {peer.system_info.strip()}")
    decode = {n: t.medians()[0] for n, t in tallies.items()}
    for q4 in (n for n in decode if n.startswith("quantkit 4-bit")):
        for peer_name in (n for n in decode if n.startswith("llama.cpp")):
            print(f"decode ratio {q4} / {peer_name}: {decode[q4] / decode[peer_name]:.2f}x")
    if "llama.cpp F32" in decode:
        print(f"decode ratio quantkit fp32 / llama.cpp F32: "
              f"{decode['quantkit fp32 (float model)'] / decode['llama.cpp F32']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp-venv", required=True, metavar="VENV", help="a venv with llama-cpp-python and gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quants", default="Q4_0,Q4_K_M", help="llama.cpp quantization types (LLAMA_FTYPE_MOSTLY_*)")
    ap.add_argument("--model", help="a float HF Llama to use instead of the random one")
    ap.add_argument("--gptq", help="its 4-bit GPTQ checkpoint (needed with --model)")
    ap.add_argument("--log", default="out/llamacpp-bench.log", help="where llama.cpp's stderr goes")
    ap.add_argument("--gguf-dir", help="where the GGUFs are written, and reused from by later runs of the same --model")
    ap.add_argument("--quantized-only", action="store_true",
                    help="only the 4-bit systems: no float rows, the GGUFs quantized from an F16 file (8B shapes)")
    ap.add_argument("--bound", action="store_true",
                    help="after each round, the read bandwidth of the moment, and each decode as a fraction of its bound")
    ap.add_argument("--ttft", metavar="N,N", help="instead: time to first token at these prompt lengths (with RSS)")
    ap.add_argument("--bf16", action="store_true", help="--ttft: also quantkit's engine on the float model in bf16")
    ap.add_argument("--vllm-venv", help="--ttft: also vLLM's CPU build (in this venv) on the 4-bit checkpoint")
    ap.add_argument("--vllm-log", default="out/vllm-ttft.log", help="where vLLM's log goes")
    ap.add_argument("--int8-activations", nargs="?", const="also", choices=("also", "only"),
                    help="also (or, `only`, instead of W4A16) each 4-bit checkpoint with --cpu-int8-activations "
                         "(W4A8: the AVX-512 VNNI kernel in bf16, on AMX-INT8 tiles where granted; the AVX2 one "
                         "in fp32): two 8B engines in one process do not fit 24 GiB beside llama.cpp")
    ap.add_argument("--w4a16", action="store_true",
                    help="also each 4-bit checkpoint with --no-cpu-int8-prefill (bf16 CPUs: W4A16 prompts too)")
    args = ap.parse_args()
    if bool(args.model) != bool(args.gptq):
        raise SystemExit("--model and --gptq go together")
    if not (Path(args.llamacpp_venv) / "bin" / "python").exists():
        raise SystemExit(f"no python in {args.llamacpp_venv}: python3 -m venv VENV && "
                         "VENV/bin/pip install llama-cpp-python gguf")
    args.llamacpp_venv = str(Path(args.llamacpp_venv).absolute())  # the worker starts in another folder
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.ttft:
            from quantkit.bench.llamacpp_ttft import ttft_table

            ttft_table(args, Path(tmp))
        else:
            compare(args, Path(tmp))


if __name__ == "__main__":
    main()
