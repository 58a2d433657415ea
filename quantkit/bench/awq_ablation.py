"""AWQ's architecture choices one at a time: the GQA v -> o tie and which linears are clipped,
toggled through the arch spec (they are data), each variant quantized in this process and scored.

  python -m quantkit.bench.awq_ablation MODEL --group-size 64 \
      [--variants base,noclip,tie,tie+noclip,tie+duo] [--seeds 0,1,2] [--threads 2] [--compute-dtype float32]

Variants: `tie` keeps LinearGroup.feeder_repeats_kv (v -> o scaled under GQA, one value per KV-head
channel), `noclip` leaves q/k unclipped (llm-awq's and AutoAWQ's choice; quantkit clips every linear
unless the spec's awq_no_clip says otherwise), `clipnone` clips no linear (as
llm-compressor's AWQModifier), `duo` turns on duo scaling, `both` searches both formulas per group; `base` has none of them. Calibration 32 x 256 tokens of wikitext2/valid.txt (seed 0, or each of `--seeds`); perplexity on the first
20,000 tokens of wikitext2/test.txt in 256-token windows, as quantkit.bench.vs_llmcompressor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from quantkit.bench.vs_llmcompressor import CALIB, NSAMPLES, PPL_SEQLEN, PPL_TEXT, PPL_TOKENS, SEQLEN


QK = ("self_attn.q_proj", "self_attn.k_proj")


def spec_variant(spec, tie: bool, noclip: bool, clipnone: bool = False):
    """The real spec with the AWQ choices switched on or off (`clipnone`: no linear clipped, as llm-compressor's
    AWQModifier)."""
    groups = tuple(dataclasses.replace(g, feeder_repeats_kv=g.feeder_repeats_kv and tie) for g in spec.groups)
    no_clip = spec.linears if clipnone else QK if noclip else spec.awq_no_clip
    return dataclasses.replace(spec, groups=groups, awq_no_clip=no_clip)


def quantize_variant(cfg, out: Path, variant: str):
    """cfg quantized into `out` with the spec of `variant` (names joined by "+", see the module's doc); the report."""
    from quantkit.model.source import open_model
    from quantkit.quant import pipeline

    parts = set(variant.split("+"))
    source = open_model(cfg.model)
    spec = spec_variant(source.spec, "tie" in parts, "noclip" in parts, "clipnone" in parts)
    return pipeline.quantize_model(cfg, out, show_progress=False, source=source.with_spec(spec))


def score(path: Path, ids: torch.Tensor, note: str) -> float:
    from quantkit.eval.perplexity import perplexity
    from quantkit.model.loader import load_model

    model, _ = load_model(path)
    return perplexity(model.eval(), ids, PPL_SEQLEN, "wikitext2/test.txt", note).ppl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--variants", default="base,noclip,tie,tie+noclip,tie+duo")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seeds", default="0", help="calibration seeds, comma-separated: each variant once per seed")
    ap.add_argument("--compute-dtype", default="auto", help="the calibration forward passes' dtype (QuantizeConfig.compute_dtype)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.eval.perplexity import tokenize_once
    from quantkit.model.loader import load_tokenizer

    ids, note = tokenize_once(load_tokenizer(args.model), PPL_TEXT.read_text(encoding="utf-8"))
    ids = ids[:PPL_TOKENS]
    base = score(args.model, ids, note)
    print(f"# {args.model.name}: group {args.group_size}, float ppl {base:.3f}, threads {args.threads}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-awq-ablation-") as tmp:
        for name, seed in ((v, int(x)) for v in args.variants.split(",") for x in args.seeds.split(",")):
            parts = set(name.split("+"))
            out = Path(tmp) / f"{name}-{seed}"
            cfg = QuantizeConfig(model=str(args.model), out=out, method="awq", group_size=args.group_size,
                                 awq_duo_scaling="both" if "both" in parts else str("duo" in parts).lower(), compute_dtype=args.compute_dtype,
                                 calib=CalibConfig(source=str(CALIB), nsamples=NSAMPLES, seqlen=SEQLEN, seed=seed))
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            report = quantize_variant(cfg, out, name)
            ppl = score(out, ids, note)
            print(json.dumps({"variant": name, "seed": seed, "ppl": round(ppl, 3), "x_float": round(ppl / base, 4),
                              "quantize_s": round(report.seconds, 1), "load_avg": round(os.getloadavg()[0], 1)}),
                  flush=True)


if __name__ == "__main__":
    main()
