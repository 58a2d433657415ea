"""What int8 activations (W4A8, EngineConfig.cpu_int8_activations) and an int8 lm_head (cpu_int8_lm_head) cost in
accuracy: perplexity of a 4-bit checkpoint in bf16 with the W4A16 kernel and with the W4A8 one, each with its float
lm_head and with it held in int8 (kernels/int8_cpu.py), beside the float model (and it with an int8 head), one process.
Beside perplexity, each variant's next-token distributions are compared with the float model's on the same tokens:
the mean KL divergence KL(float || variant) per prediction, and how often the two argmax tokens agree (what
llama.cpp's perplexity tool reports as KLD and "same top p").

  python benchmarks/int8_activations.py [--model tiny|stories] [--method gptq] [--threads 2]

The model is quantized as quantkit.bench.vs_llmcompressor does (calibration 32 x 256 tokens of
wikitext2/valid.txt, seed 0; the GQA model at group 128, stories260K at group 64) and scored on the first
20,000 tokens of wikitext2/test.txt in 128-token windows, one window a forward: 128 rows a call stay
below the dense crossover (160), so every quantized linear runs the kernel being measured. Both runs read
the same repacked weights; only the kernel the direct call picks differs.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quantkit.bench.vs_llmcompressor import CALIB, NSAMPLES, PPL_TEXT, PPL_TOKENS, SEQLEN, model_entry

WINDOW = 128


@dataclass(frozen=True)
class Score:
    ppl: float
    kl: float  # mean KL(float || this) per prediction, nats
    top1: float  # share of predictions whose argmax equals the float model's

    def describe(self) -> str:
        return f"ppl {self.ppl:.4f}, KL {self.kl:.3e}, top-1 agreement {100 * self.top1:.2f}%"


def divergence(base_logp: torch.Tensor, logp: torch.Tensor) -> tuple[float, float]:
    """Mean KL(base || this) per row and the share of rows with the same argmax: [N, V] log-probs each (the
    per-position figures of quantkit.eval.fidelity, which the suite benchmark reports)."""
    from quantkit.eval.fidelity import token_kl, top1_matches

    return float(token_kl(base_logp, logp).mean()), float(top1_matches(base_logp, logp).float().mean())


def window_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """fp32 log-probs of every scored prediction, [windows * (WINDOW - 1), V], one window a forward."""
    from quantkit.eval.windows import disjoint_windows

    rows = [F.log_softmax(model(ids[a:b][None]).logits[0, :-1].float(), dim=-1)
            for a, b in disjoint_windows(len(ids), WINDOW)]
    return torch.cat(rows)


def score(model, ids: torch.Tensor, base: torch.Tensor | None = None) -> tuple[Score, torch.Tensor]:
    """`model` scored on `ids`; against `base` (the float model's log-probs), or against itself when None."""
    from quantkit.eval.windows import disjoint_windows

    logp = window_logprobs(model.eval(), ids)
    targets = torch.cat([ids[a + 1:b] for a, b in disjoint_windows(len(ids), WINDOW)])
    nll = -logp.gather(-1, targets[:, None]).mean()
    kl, top1 = divergence(logp if base is None else base, logp)
    return Score(math.exp(float(nll)), kl, top1), logp


def int8_head(model):
    """`model` (transformers, bf16) with its lm_head held in int8 as the engine's cpu_int8_lm_head holds it."""
    from quantkit.kernels.int8_cpu import Int8Linear

    model.lm_head = Int8Linear.from_linear(model.lm_head)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, stories or a model of the accuracy suite")
    ap.add_argument("--method", default="gptq", choices=("rtn", "gptq", "awq"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.eval.perplexity import tokenize_once
    from quantkit.model.loader import load_model, load_tokenizer
    from quantkit.model.quant_linear import QuantLinear
    from quantkit.quant.pipeline import quantize_model

    path, group_size, _ = model_entry(args.model)
    ids, _ = tokenize_once(load_tokenizer(path), PPL_TEXT.read_text(encoding="utf-8"))
    ids = ids[:PPL_TOKENS]
    with torch.inference_mode():
        base, base_logp = score(load_model(path, dtype=torch.bfloat16)[0], ids)
        head8, _ = score(int8_head(load_model(path, dtype=torch.bfloat16)[0]), ids, base_logp)
    print(f"# {args.model}: float (bf16) {base.describe()}; with an int8 lm_head {head8.describe()} "
          f"({head8.ppl / base.ppl:.5f}x)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-int8-act-") as tmp:
        out = Path(tmp)
        cfg = QuantizeConfig(model=str(path), out=out, method=args.method, group_size=group_size,
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
                got, _ = score(model, ids, base_logp)
            print(f"{args.method} 4-bit, {'int8' if int8 else 'bf16'} activations, {'int8' if head else 'float'} "
                  f"lm_head ({', '.join(sorted(paths))}): "
                  f"{got.describe()} ({got.ppl / base.ppl:.4f}x float)", flush=True)


if __name__ == "__main__":
    main()
