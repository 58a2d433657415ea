"""llm-compressor as a baseline: RTN, GPTQ or AWQ W4A16 on a local model, then wikitext perplexity.

Runs in the llm-compressor venv (.venvs/llmc: torch 2.13 cpu, llmcompressor 0.14, transformers
5.17), never in quantkit's venv, and imports nothing from quantkit (quantkit.bench.vs_llmcompressor runs it
beside quantkit). From the repository root:

    .venvs/llmc/bin/python tests/interop/llmcompressor_gptq.py \
        --model ../shared/data/stories260K-hf --method gptq --group-size 64 \
        --calib ../shared/data/wikitext2/test.txt --nsamples 128 --seqlen 512 --seed 0 \
        --ppl-text ../shared/data/wikitext2/test.txt --out out/llmc-gptq

Same inputs as `quantkit quantize`, re-implemented here (the two venvs cannot share code):
  calibration: the .txt split into documents on blank lines, joined by "\\n\\n", tokenized once
      without special tokens, `nsamples` windows of `seqlen` tokens at offsets drawn by
      torch.Generator().manual_seed(seed).randint (calibration/data.py); the sha256 of the window
      ids is printed so it can be compared with quantkit_meta.json's token hash.
  quantized linears: --targets attention (q/k/v/o_proj: stories260K's MLP, intermediate 172, cannot be
      packed) or all (every decoder linear), 4-bit, symmetric for GPTQ (no act-order, damp 0.01,
      block 128), asymmetric for RTN and AWQ (--duo: AWQModifier's duo scaling, its default).
      AWQ with --targets all uses llm-compressor's own mappings for the architecture (what a user gets).
  perplexity: the text tokenized once with the tokenizer's default special tokens, non-overlapping
      windows of --ppl-seqlen tokens (tail dropped), each scored alone (quantkit/eval/perplexity.py).
The perplexity is measured on the checkpoint as saved (compressed-tensors) and re-loaded, plus the
float model by the same code, so the two columns can be compared with quantkit's; --no-ppl measures neither (random
weights at a real shape: only the time and the process's peak RSS, VmHWM, printed with every run, count).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data from the repository root

TARGETS = {"attention": ["re:.*self_attn\\.(q|k|v|o)_proj$"], "all": ["Linear"]}


def split_documents(text: str) -> list[str]:
    docs, current = [], []
    for line in text.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            docs.append("\n".join(current))
            current = []
    if current:
        docs.append("\n".join(current))
    return docs


def calibration_windows(tok, path: str, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """[nsamples, seqlen] int64, as quantkit's load_calibration cuts them."""
    docs = [d for d in split_documents(Path(path).read_text(encoding="utf-8")) if d.strip()]
    ids = torch.tensor(tok("\n\n".join(docs), add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.int64)
    seqlen = min(seqlen, ids.numel())
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seqlen + 1, (nsamples,), generator=gen)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])


DUO = {"false": False, "true": True, "both": "both"}  # --duo -> AWQModifier's duo_scaling


def recipe(method: str, group_size: int, damp: float, targets: str = "attention", duo: bool | str = False):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    sym = method == "gptq"
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=group_size)
    groups = {"group_0": QuantizationScheme(targets=TARGETS[targets], weights=weights)}
    if method == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        return [GPTQModifier(config_groups=groups, ignore=["lm_head"], actorder=None, dampening_frac=damp,
                             block_size=128)]
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier

    if method == "rtn":
        return [QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    if targets == "all":
        return [AWQModifier(duo_scaling=duo, n_grid=20), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    # Attention only, like ours: the norm feeds q/k/v; v_proj -> o_proj (skipped by llm-compressor under GQA).
    mappings = [AWQMapping("re:.*input_layernorm$", ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]),
                AWQMapping("re:.*v_proj$", ["re:.*o_proj$"])]
    return [AWQModifier(mappings=mappings, duo_scaling=duo, n_grid=20),
            QuantizationModifier(config_groups=groups, ignore=["lm_head"])]


def patch_cpu_pin_memory() -> None:
    """AWQ pins cached activations for faster host->device copies; pin_memory() fails without an accelerator."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


@torch.no_grad()
def perplexity(model, tok, path: str, seqlen: int, max_tokens: int | None = None) -> tuple[float, int]:
    ids = tok(Path(path).read_text(encoding="utf-8"), return_tensors="pt").input_ids[0][:max_tokens]
    n = ids.numel() // seqlen
    total = 0.0
    for i in range(0, n, 4):
        batch = torch.stack([ids[j * seqlen:(j + 1) * seqlen] for j in range(i, min(i + 4, n))])
        logp = torch.log_softmax(model(batch).logits[:, :-1].float(), dim=-1)
        total += float(-logp.gather(-1, batch[:, 1:, None]).sum())
    return math.exp(total / (n * (seqlen - 1))), n


def run(args) -> dict:
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    windows = calibration_windows(tok, args.calib, args.nsamples, args.seqlen, args.seed)
    token_hash = hashlib.sha256(windows.numpy().tobytes()).hexdigest()
    ds = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": torch.ones_like(windows).tolist()})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    float_ppl = None if args.skip_float_ppl or args.no_ppl else perplexity(model, tok, args.ppl_text, args.ppl_seqlen, args.ppl_tokens)[0]
    if args.method == "awq":
        patch_cpu_pin_memory()
    start, cpu_start = time.perf_counter(), time.process_time()
    oneshot(model=model, dataset=ds, recipe=recipe(args.method, args.group_size, args.damp, args.targets, DUO[args.duo]),
            num_calibration_samples=args.nsamples, max_seq_length=windows.shape[1],
            shuffle_calibration_samples=False, pipeline="sequential")
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    quant_ppl, n_windows = None, 0
    if not args.no_ppl:
        reloaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
        quant_ppl, n_windows = perplexity(reloaded, tok, args.ppl_text, args.ppl_seqlen, args.ppl_tokens)
    return {"method": args.method, "targets": args.targets, "duo": args.duo, "ppl_tokens": args.ppl_tokens, "group_size": args.group_size, "nsamples": args.nsamples,
            "seqlen": int(windows.shape[1]), "seed": args.seed, "calib_token_sha256": token_hash,
            "oneshot_wall_s": round(wall, 2), "oneshot_cpu_s": round(cpu, 2), "ppl_text": args.ppl_text, "ppl_seqlen": args.ppl_seqlen,
            "ppl_windows": n_windows, "float_ppl": float_ppl, "quant_ppl": quant_ppl, "out": str(args.out),
            "threads": torch.get_num_threads(), "peak_rss_bytes": peak_rss_bytes()}


def peak_rss_bytes() -> int:
    """This process's high-water resident set (VmHWM; Linux), as quantkit.bench.peak_rss reads its own."""
    status = Path("/proc/self/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmHWM:"))) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="store_true", help="print llm-compressor's version and exit (checks the venv)")
    ap.add_argument("--model", default=str(SHARED_DATA / "stories260K-hf"))
    ap.add_argument("--method", choices=("rtn", "gptq", "awq"), default="gptq")
    ap.add_argument("--targets", choices=tuple(TARGETS), default="attention")
    ap.add_argument("--duo", nargs="?", const="true", default="false", choices=("false", "true", "both"),
                    help="AWQ: duo scaling (AWQModifier's default: true), or both formulas searched")
    ap.add_argument("--ppl-tokens", type=int, default=None, help="score only the first N tokens of --ppl-text")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--calib", default=str(SHARED_DATA / "wikitext2" / "test.txt"))
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ppl-text", default=str(SHARED_DATA / "wikitext2" / "test.txt"))
    ap.add_argument("--ppl-seqlen", type=int, default=512)
    ap.add_argument("--skip-float-ppl", action="store_true", help="do not score the float model")
    ap.add_argument("--no-ppl", action="store_true", help="score neither model (random weights: time and RSS only)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.version:
        from importlib.metadata import version

        import llmcompressor  # noqa: F401  (the import is the check)

        print(f"llmcompressor {version('llmcompressor')}")
        return
    if args.out is None:
        ap.error("--out is required")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    print("RESULT " + json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
