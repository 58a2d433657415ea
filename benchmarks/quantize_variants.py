"""Quantize one model with several QuantizeConfig variants in this process, score each, optionally profile.

  python benchmarks/quantize_variants.py [--model tiny|stories] [--threads 2] [--profile] \
      gptq gptq:true_sequential=True awq awq:awq_search_tokens=0,awq_duo_scaling=both

A variant is `method[:field=value,...]` (QuantizeConfig fields; true/false, ints and floats parsed,
other values kept as text, e.g. compute_dtype=float32; `seed=N` draws the calibration windows with
seed N instead of 0).
Calibration and scoring as quantkit.bench.vs_llmcompressor (32 x 256 tokens of wikitext2/valid.txt,
seed 0; perplexity on the first 20,000 tokens of wikitext2/test.txt in 256-token windows). Each
variant prints one JSON line: perplexity, ratio to float, the pipeline's seconds, a hash of the
written weights (to compare runs, e.g. at 1 and 2 threads); --profile adds cProfile's top
functions. The float model is scored first, so imports and first-call set-up are warm.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import tempfile
import time
from pathlib import Path

import torch

from quantkit.bench.vs_llmcompressor import CALIB, NSAMPLES, PPL_SEQLEN, PPL_TEXT, PPL_TOKENS, SEQLEN, model_entry


def parse_variant(text: str) -> tuple[str, dict]:
    method, _, rest = text.partition(":")
    fields = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        fields[key] = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(fields[key], str):
            fields[key] = _number_or_text(value)
    return method, fields


def _number_or_text(value: str):
    try:
        return float(value) if "." in value else int(value)
    except ValueError:
        return value  # e.g. compute_dtype=float32


def weights_hash(out: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        digest.update(f.read_bytes())
    return digest.hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--model", default="tiny", help="tiny, stories or a model of the accuracy suite")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.eval.perplexity import perplexity, tokenize_once
    from quantkit.model.loader import load_model, load_tokenizer
    from quantkit.quant.pipeline import quantize_model

    model, group_size, _ = model_entry(args.model)
    ids, note = tokenize_once(load_tokenizer(model), PPL_TEXT.read_text(encoding="utf-8"))

    def score(path: Path) -> float:
        return perplexity(load_model(path)[0].eval(), ids[:PPL_TOKENS], PPL_SEQLEN, "wikitext2/test.txt", note).ppl

    base = score(model)
    print(f"# {args.model}: float ppl {base:.3f}, threads {args.threads}, load {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-variants-") as tmp:
        for i, text in enumerate(args.variants):
            method, fields = parse_variant(text)
            seed = int(fields.pop("seed", 0))
            out = Path(tmp) / str(i)
            out.mkdir()
            cfg = QuantizeConfig(model=str(model), out=out, method=method, group_size=group_size,
                                 calib=CalibConfig(source=str(CALIB), nsamples=NSAMPLES, seqlen=SEQLEN, seed=seed), **fields)
            prof = cProfile.Profile() if args.profile else None
            start = time.perf_counter()
            if prof:
                prof.enable()
            quantize_model(cfg, out, show_progress=False)
            if prof:
                prof.disable()
            seconds = time.perf_counter() - start
            ppl = score(out)
            print(json.dumps({"variant": text, "threads": args.threads, "ppl": round(ppl, 3), "x_float": round(ppl / base, 4),
                              "seconds": round(seconds, 2), "weights": weights_hash(out),
                              "load_avg": round(os.getloadavg()[0], 2)}), flush=True)
            if prof:
                pstats.Stats(prof).sort_stats("cumulative").print_stats(35)


if __name__ == "__main__":
    main()
