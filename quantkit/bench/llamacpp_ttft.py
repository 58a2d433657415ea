"""The time-to-first-token table of `python -m quantkit.bench.vs_llamacpp --ttft N,N` (its docstring says what is
run): quantkit's engine, llama.cpp and optionally vLLM's CPU build, each loaded once, timed in alternating rounds on
fresh prompts, with their resident memory."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.bench.vs_llamacpp import MiB, Arithmetic, LlamaCpp, Quantkit, activation_variants, prepare


@dataclass
class Held:
    """One system of the time-to-first-token table: its timer (prompt -> seconds), its process, the KV cache it
    holds, and its resident set after load and at the end (bytes)."""

    first_token_s: Callable[[list[int]], float]
    pid: int | str
    kv: str
    rss_after_load: int = 0
    rss_at_end: int = 0


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def kv_bytes_per_token(model: Path) -> int:
    """K and V of every layer for one token, in 16-bit: what llama.cpp's default f16 KV cache holds a token."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2


def ttft_systems(args, tmp: Path, n_ctx: int) -> tuple[dict[str, Held], list]:
    """quantkit (4-bit, and bf16 with --bf16, in this process), llama.cpp (one worker per --quants type) and, with
    --vllm-venv, vLLM on the 4-bit checkpoint; each loaded and its RSS read. Also what must be closed."""
    from quantkit.bench.peak_rss import rss_bytes
    from quantkit.bench.vllm_process import VLLM
    from quantkit.devices import auto_cpu_dtype

    dense, gptq, ggufs = prepare(args, tmp)
    checkpoint = gptq["4-bit GPTQ"]
    kv = kv_bytes_per_token(dense) * n_ctx
    same = f"{n_ctx} tokens, {kv / MiB:.0f} MiB"
    auto, held, closing = auto_cpu_dtype()[0], {}, []
    systems = [(f"4-bit GPTQ, {a.suffix}", checkpoint, auto, a) for a in activation_variants(args, auto)]
    if args.bf16:
        systems.append(("bf16", dense, "bfloat16", Arithmetic("bf16")))
    for i, (label, model, dtype, a) in enumerate(systems):
        kv_q = kv * getattr(torch, dtype).itemsize // 2  # the engine's cache is in its dtype: fp32 takes twice f16's
        q = Quantkit(model, dtype, args.threads, a.int8_activations, n_ctx=n_ctx, kv_cache_memory=kv_q,
                     int8_prefill=a.int8_prefill)
        note = "; the process also holds the models above" if i else ""
        held[f"quantkit {label}"] = Held(q.first_token_s, "self", f"{n_ctx} tokens, {kv_q / MiB:.0f} MiB, {dtype}{note}",
                                         rss_bytes())
    python = Path(args.llamacpp_venv) / "bin" / "python"
    for kind in (k for k in ggufs if k != "F32"):
        peer = LlamaCpp(python, {kind: ggufs[kind]}, args.threads, Path(args.log).resolve(), n_ctx)
        closing.append(peer)
        held[f"llama.cpp {kind}"] = Held(lambda p, peer=peer, kind=kind: peer.run(kind, p, 1).prefill_s,
                                         peer.worker.proc.pid, f"{same}, f16", rss_bytes(peer.worker.proc.pid))
    if args.vllm_venv:
        vllm = VLLM(Path(args.vllm_venv), checkpoint, auto, args.threads, Path(args.vllm_log), n_ctx,
                    pause_idle=True, kv_cache_gib=1)
        closing.append(vllm)
        held["vLLM 4-bit GPTQ"] = Held(lambda p: vllm.run([p], 1)[0], vllm.proc.pid,
                                       f"1 GiB pool (VLLM_CPU_KVCACHE_SPACE=1, its least), {auto}", vllm.rss())
    return held, closing


def ttft_table(args, tmp: Path) -> None:
    """Time to first token at each --ttft prompt length, batch 1, every system once a round in alternating order,
    a fresh random prompt each round (so that no prefix cache answers it); seconds, ratios and resident memory."""
    from quantkit.bench.peak_rss import rss_bytes
    from quantkit.bench.rounds import round_order

    lengths = sorted(int(n) for n in args.ttft.split(","))
    n_ctx = max(lengths) + 64
    held, closing = ttft_systems(args, tmp, n_ctx)
    vocab = json.loads(((Path(args.model) if args.model else tmp / "bf16") / "config.json").read_text())["vocab_size"]
    names = list(held)
    for name in names:  # warm-up, not counted
        held[name].first_token_s(random_prompt(64, vocab, 1))
    seconds = {(n, L): [] for n in names for L in lengths}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for L in lengths:
            prompt = random_prompt(L, vocab, 1000 * (r + 1) + L)
            for name in round_order(names, r):
                seconds[name, L].append(held[name].first_token_s(prompt))
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + ", ".join(f"{n} @{L} {seconds[n, L][-1]:.2f} s" for n in names for L in lengths)
              + f"; load {loads[-1]:.1f}", flush=True)
    for h in held.values():
        h.rss_at_end = rss_bytes(h.pid)
    for c in closing:
        if hasattr(c, "idle_cores"):
            print(f"vLLM's worker idle after its jobs: {c.idle_cores():.2f} cores busy over 3 s (so it was stopped "
                  f"with SIGSTOP between its jobs)")
    for c in closing:
        c.close()
    ttft_report(args, held, seconds, lengths, loads)


def ttft_report(args, held: dict[str, Held], seconds: dict, lengths: list[int], loads: list[float]) -> None:
    med = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"\n== time to first token, batch 1, {args.threads} threads each, median of {args.rounds} alternating "
          f"rounds (fresh prompt each round); load average {min(loads):.1f}-{max(loads):.1f}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| system | " + " | ".join(f"TTFT @{L} s (range)" for L in lengths)
          + " | RSS after load | RSS at end | KV cache held |")
    print("|---|" + "---|" * (len(lengths) + 3))
    for name, h in held.items():
        cells = [f"{med[name, L]:.2f} ({min(seconds[name, L]):.2f}-{max(seconds[name, L]):.2f})" for L in lengths]
        print(f"| {name} | " + " | ".join(cells)
              + f" | {h.rss_after_load / MiB:.0f} MiB | {h.rss_at_end / MiB:.0f} MiB | {h.kv} |")
    print()
    for ours in (n for n in held if n.startswith("quantkit")):
        for peer in (n for n in held if not n.startswith("quantkit")):
            print(f"TTFT ratio {ours} / {peer}: "
                  + ", ".join(f"{med[ours, L] / med[peer, L]:.2f}x @{L}" for L in lengths))
