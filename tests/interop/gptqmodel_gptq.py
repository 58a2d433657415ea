"""GPTQModel as a baseline: its GPTQ W4 (symmetric, static groups, GAR on or off) on a local model, on the CPU.

Runs in GPTQModel's own venv (torch 2.13.0+cpu, gptqmodel 7.3.6, requests: docs/accuracy.md says how to make it),
never in quantkit's, and imports nothing from quantkit. `python -m quantkit.bench.vs_llmcompressor --tools gptqmodel`
runs it beside quantkit and llm-compressor, then scores the checkpoint it saves (GPTQ v1) with quantkit's perplexity
code, against the float perplexity of the same code. From the repository root:

    $GPTQMODEL_PYTHON tests/interop/gptqmodel_gptq.py --model ~/.cache/quantkit/suite/mha-w64-d4 \
        --group-size 64 --calib ../shared/data/wikitext2/valid.txt --nsamples 32 --seqlen 256 --seed 0 \
        --threads 1 --out out/gptqmodel-gptq
    $GPTQMODEL_PYTHON tests/interop/gptqmodel_gptq.py --version     # checks that the venv imports GPTQModel

Calibration: llmcompressor_gptq.calibration_windows (this folder), the windows `quantkit quantize` cuts; the sha256
of their ids is printed to be compared with quantkit's. QuantizeConfig: bits 4, the group size, sym, desc_act off,
damp 0.01, act_group_aware (GAR: GPTQModel's default for GPTQ is on) as --gar says, GPTAQ with --gptaq ALPHA; with --targets attention the
MLP is left in float (stories260K: its intermediate 172 does not split into groups).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

DYNAMIC = {"attention": {r"-:.*mlp\..*": {}}, "all": None}  # --targets -> QuantizeConfig.dynamic ("-:" skips)
GAR = {"true": True, "false": False}  # --gar -> QuantizeConfig.act_group_aware


def import_gptqmodel():
    """The gptqmodel module, with the two workarounds that 7.3.6 needs in a CPU-only venv on a small machine."""
    import transformers  # noqa: F401  (imported first: it must see torchvision as not installed)

    # 7.3.6 imports torchvision at import time for one vision model's definition (InternVL) but does not require
    # it, and PyPI's torchvision is a CUDA build that cannot load beside torch's CPU wheel: empty stand-in modules
    # serve that one import when torchvision is absent (nothing here uses them).
    if importlib.util.find_spec("torchvision") is None:
        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["torchvision.transforms.functional"].InterpolationMode = None
    # Its thread pool sizes the CPU workers as (cores + 1) // 2, 1 on 2 cores, while its model loader asks for 2 of
    # them, so the pool refuses to start: 2 workers unless the caller chose.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    try:
        import gptqmodel
    except ImportError as exc:
        raise SystemExit(f"gptqmodel does not import with {sys.executable}: {exc}") from None
    return gptqmodel


def run(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    from llmcompressor_gptq import calibration_windows  # beside this script (its folder is sys.path[0])
    from transformers import AutoTokenizer

    gptqmodel = import_gptqmodel()
    tok = AutoTokenizer.from_pretrained(args.model)
    windows = calibration_windows(tok, args.calib, args.nsamples, args.seqlen, args.seed)  # [nsamples, seqlen]
    calib = [{"input_ids": w.tolist(), "attention_mask": [1] * w.numel()} for w in windows]
    gptaq = {} if args.gptaq is None else {"gptaq": {"alpha": args.gptaq}}  # GPTAQConfig(alpha=...)
    cfg = gptqmodel.QuantizeConfig(bits=4, group_size=args.group_size, sym=True, desc_act=False,
                                   damp_percent=args.damp, dynamic=DYNAMIC[args.targets], act_group_aware=GAR[args.gar],
                                   **gptaq)
    model = gptqmodel.GPTQModel.load(args.model, cfg, device="cpu", dtype=torch.float32)
    start = time.perf_counter()
    model.quantize(calib, batch_size=1, tokenizer=tok)
    wall = time.perf_counter() - start
    model.save(str(args.out))
    return {"gptqmodel": gptqmodel.__version__, "gar": GAR[args.gar], "gptaq_alpha": args.gptaq, "targets": args.targets,
            "group_size": args.group_size, "seed": args.seed, "quantize_wall_s": round(wall, 2),
            "calib_token_sha256": hashlib.sha256(windows.numpy().tobytes()).hexdigest(), "out": str(args.out),
            "threads": torch.get_num_threads()}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="store_true", help="print GPTQModel's version and exit (checks the venv)")
    ap.add_argument("--model")
    ap.add_argument("--targets", choices=tuple(DYNAMIC), default="all")
    ap.add_argument("--gar", choices=tuple(GAR), default="true", help="act_group_aware (GPTQModel's default: true)")
    ap.add_argument("--gptaq", type=float, default=None, metavar="ALPHA",
                    help="GPTQ with asymmetric calibration (QuantizeConfig.gptaq = GPTAQConfig(alpha=ALPHA))")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--calib")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--out", type=Path)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.version:
        print(f"gptqmodel {import_gptqmodel().__version__}")
        return
    if not (args.model and args.calib and args.out):
        ap.error("--model, --calib and --out are required")
    print("RESULT " + json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
