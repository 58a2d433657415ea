"""What int8 activations (W4A8, EngineConfig.cpu_int8_activations) and an int8 lm_head (cpu_int8_lm_head) cost in
accuracy: perplexity of a 4-bit checkpoint in bf16 with the W4A16 kernel and with the W4A8 one, each with its float
lm_head and with it held in int8 (kernels/int8_cpu.py), beside the float model (and it with an int8 head), one process.

  python -m quantkit.bench.int8_activations [--model tiny|stories] [--method gptq] [--threads 2]

The model is quantized as quantkit.bench.vs_llmcompressor does (calibration 32 x 256 tokens of
wikitext2/valid.txt, seed 0; the GQA model at group 128, stories260K at group 64) and scored on the first
20,000 tokens of wikitext2/test.txt in 128-token windows, one window a forward: 128 rows a call stay
below the dense crossover (160), so every quantized linear runs the kernel being measured. Both runs read
the same repacked weights; only the kernel the direct call picks differs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from quantkit.bench.vs_llmcompressor import CALIB, MODELS, NSAMPLES, PPL_TEXT, PPL_TOKENS, SEQLEN, model_path

WINDOW = 128


def score(model, ids: torch.Tensor, note: str) -> float:
    from quantkit.eval.perplexity import perplexity

    return perplexity(model.eval(), ids, WINDOW, "wikitext2/test.txt", note, batch_size=1).ppl


def int8_head(model):
    """`model` (transformers, bf16) with its lm_head held in int8 as the engine's cpu_int8_lm_head holds it."""
    from quantkit.kernels.int8_cpu import Int8Linear

    model.lm_head = Int8Linear.from_linear(model.lm_head)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=tuple(MODELS), default="tiny")
    ap.add_argument("--method", default="gptq", choices=("rtn", "gptq", "awq"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.eval.perplexity import tokenize_once
    from quantkit.model.loader import load_model, load_tokenizer
    from quantkit.model.quant_linear import QuantLinear
    from quantkit.quant.pipeline import quantize_model

    path = model_path(args.model)
    ids, note = tokenize_once(load_tokenizer(path), PPL_TEXT.read_text(encoding="utf-8"))
    ids = ids[:PPL_TOKENS]
    with torch.inference_mode():
        base = score(load_model(path, dtype=torch.bfloat16)[0], ids, note)
        head8 = score(int8_head(load_model(path, dtype=torch.bfloat16)[0]), ids, note)
    print(f"# {args.model}: float (bf16) ppl {base:.4f}; with an int8 lm_head {head8:.4f} ({head8 / base:.5f}x)",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-int8-act-") as tmp:
        out = Path(tmp)
        cfg = QuantizeConfig(model=str(path), out=out, method=args.method, group_size=MODELS[args.model][0],
                             calib=CalibConfig(source=str(CALIB), nsamples=NSAMPLES, seqlen=SEQLEN, seed=0))
        quantize_model(cfg, out, show_progress=False)
        for int8, head in ((False, False), (True, False), (False, True), (True, True)):
            model, _ = load_model(out, dtype=torch.bfloat16)
            if head:
                int8_head(model)
            linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
            paths = {m.repack_for_cpu(torch.bfloat16, int8_activations=int8) for m in linears}
            if int8 and not all(m._direct is not None and m._direct.int8_activations for m in linears):
                raise SystemExit(f"the int8-activation kernel does not run every linear here: {sorted(paths)}")
            with torch.inference_mode():
                ppl = score(model, ids, note)
            print(f"{args.method} 4-bit, {'int8' if int8 else 'bf16'} activations, {'int8' if head else 'float'} "
                  f"lm_head ({', '.join(sorted(paths))}): "
                  f"ppl {ppl:.4f} ({ppl / base:.4f}x float)", flush=True)


if __name__ == "__main__":
    main()
