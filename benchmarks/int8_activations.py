"""What int8 activations (W4A8, EngineConfig.cpu_int8_activations) and an int8 lm_head (cpu_int8_lm_head) cost in
accuracy: perplexity of a 4-bit checkpoint in bf16 with the W4A16 kernel and with the W4A8 one, each with its float
lm_head and with it held in int8 (kernels/int8_cpu.py), beside the float model (and it with an int8 head), one process.
Beside perplexity, each variant's next-token distributions are compared with the float model's on the same tokens:
the mean KL divergence KL(float || variant) per prediction, and how often the two argmax tokens agree (what
llama.cpp's perplexity tool reports as KLD and "same top p").

  python benchmarks/int8_activations.py [--model tiny|stories] [--method gptq] [--threads 2] [--split | --x16]

`--split` measures what the engine's `cpu_int8_prefill` costs instead: each window's first half is the prompt, run in
one forward through one kernel into the KV cache, and its second half the continuation, teacher-forced through the
other; the 64 predictions of each continuation (the prompt's last position, then the continuation's) are scored, for
W4A16 / W4A16, W4A8 prompt / W4A16 continuation (the engine's split) and W4A8 / W4A8, beside the float model on the
same predictions.

`--x16` measures what the fp32 kernel's decode tiles cost (kernels/csrc/int4_x16_avx2.h: below 4 rows x is rounded to
16-bit fixed point per row and group): the model and the 4-bit checkpoint in fp32, the checkpoint scored twice on
the same windows, once a whole window a forward (its linears on the fp32 FMA tiles, x as it is) and once a token a
forward through the KV cache (every linear at one row: the 16-bit tiles), with KL(whole || token by token) beside
each one's KL to the float model.

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


def split_logprobs(model, ids: torch.Tensor, prompt_int8: bool, rest_int8: bool) -> torch.Tensor:
    """fp32 log-probs of each window's continuation predictions, [windows * WINDOW // 2, V]: the first half through
    the model, its KV cache kept, then the second half; each half's rows named prompt rows (the W4A8 kernel where
    the linears were repacked with int8_prefill) where its flag says so."""
    from contextlib import nullcontext

    from quantkit.eval.windows import disjoint_windows
    from quantkit.model.prompt_rows import PromptRows, prompt_rows

    half, rows = WINDOW // 2, []

    def rows_of(int8: bool):
        return prompt_rows(PromptRows(half)) if int8 else nullcontext()

    for a, b in disjoint_windows(len(ids), WINDOW):
        with rows_of(prompt_int8):
            first = model(ids[a:a + half][None], use_cache=True)
        with rows_of(rest_int8):
            rest = model(ids[a + half:b][None], past_key_values=first.past_key_values, use_cache=True)
        logits = torch.cat([first.logits[0, -1:], rest.logits[0, :-1]]).float()
        rows.append(F.log_softmax(logits, dim=-1))
    return torch.cat(rows)


def decode_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """window_logprobs' predictions, one token a forward through the KV cache: every linear sees one row."""
    from quantkit.eval.windows import disjoint_windows

    rows = []
    for a, b in disjoint_windows(len(ids), WINDOW):
        past, logits = None, []
        for t in range(a, b - 1):
            out = model(ids[t:t + 1][None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1])
        rows.append(F.log_softmax(torch.stack(logits).float(), dim=-1))
    return torch.cat(rows)


def split_targets(ids: torch.Tensor) -> torch.Tensor:
    from quantkit.eval.windows import disjoint_windows

    return torch.cat([ids[a + WINDOW // 2:b] for a, b in disjoint_windows(len(ids), WINDOW)])


def score(model, ids: torch.Tensor, base: torch.Tensor | None = None, split: tuple | None = None,
          token_by_token: bool = False) -> tuple[Score, torch.Tensor]:
    """`model` scored on `ids`; against `base` (the float model's log-probs), or against itself when None.
    `split`: (prompt_int8, rest_int8) to score the continuations only, as split_logprobs; `token_by_token`: the
    windows' predictions one token a forward (decode_logprobs)."""
    from quantkit.eval.windows import disjoint_windows

    if split is not None:
        logp, targets = split_logprobs(model.eval(), ids, *split), split_targets(ids)
    else:
        logp = (decode_logprobs if token_by_token else window_logprobs)(model.eval(), ids)
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
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--split", action="store_true", help="the engine's W4A8 prompt / W4A16 continuation instead")
    mode.add_argument("--x16", action="store_true", help="the fp32 kernel's 16-bit decode tiles instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from quantkit.config import CalibConfig, QuantizeConfig
    from quantkit.eval.perplexity import tokenize_once
    from quantkit.model.loader import load_model, load_tokenizer
    from quantkit.quant.pipeline import quantize_model

    path, group_size, _ = model_entry(args.model)
    ids, _ = tokenize_once(load_tokenizer(path), PPL_TEXT.read_text(encoding="utf-8"))
    ids = ids[:PPL_TOKENS]
    split = (False, False) if args.split else None
    dtype = torch.float32 if args.x16 else torch.bfloat16
    with torch.inference_mode():
        base, base_logp = score(load_model(path, dtype=dtype)[0], ids, split=split)
        head8, _ = score(int8_head(load_model(path, dtype=dtype)[0]), ids, base_logp, split=split)
    print(f"# {args.model}: float ({'fp32' if args.x16 else 'bf16'}) {base.describe()}; with an int8 lm_head "
          f"{head8.describe()} ({head8.ppl / base.ppl:.5f}x){' (continuations only)' if args.split else ''}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-int8-act-") as tmp:
        out = Path(tmp)
        cfg = QuantizeConfig(model=str(path), out=out, method=args.method, group_size=group_size,
                             calib=CalibConfig(source=str(CALIB), nsamples=NSAMPLES, seqlen=SEQLEN, seed=0))
        quantize_model(cfg, out, show_progress=False)
        runs = x16_runs if args.x16 else split_runs if args.split else whole_runs
        runs(args.method, out, ids, base, base_logp)


def quantized(out: Path, head: bool, int8: bool, int8_prefill: bool = False, dtype: torch.dtype = torch.bfloat16):
    """The 4-bit checkpoint in `dtype`, its linears repacked for the CPU kernels (W4A8 where `int8`, prompt rows W4A8
    where `int8_prefill`), the lm_head in int8 where `head`; (model, its QuantLinears, the paths they run)."""
    from quantkit.model.loader import load_model
    from quantkit.model.quant_linear import QuantLinear

    model, _ = load_model(out, dtype=dtype)
    if head:
        int8_head(model)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    paths = {m.repack_for_cpu(dtype, int8_activations=int8, int8_prefill=int8_prefill) for m in linears}
    return model, linears, paths


def x16_runs(method: str, out: Path, ids: torch.Tensor, base: Score, base_logp: torch.Tensor) -> None:
    """The fp32 checkpoint a window a forward (FMA tiles) and a token a forward (the 16-bit decode tiles), float
    lm_head: each against the float model, and the token-by-token run against the whole-window one."""
    from quantkit.kernels import int4_cpu

    model, linears, paths = quantized(out, head=False, int8=False, dtype=torch.float32)
    x16 = [m for m in linears if m._direct is not None and int4_cpu.x16_tiles_take(m._cpu)]
    if not hasattr(int4_cpu.extension(), "int4_linear_x16") or len(x16) != len(linears):
        raise SystemExit(f"the fp32 kernel's 16-bit decode tiles do not take every linear here: {sorted(paths)}")
    with torch.inference_mode():
        whole, whole_logp = score(model, ids, base_logp)
        tokens, token_logp = score(model, ids, base_logp, token_by_token=True)
    kl, top1 = divergence(whole_logp, token_logp)
    for name, got in (("a window a forward (FMA tiles)", whole), ("a token a forward (16-bit x tiles)", tokens)):
        print(f"{method} 4-bit fp32, float lm_head, {name} ({', '.join(sorted(paths))}): {got.describe()} "
              f"({got.ppl / base.ppl:.5f}x float)", flush=True)
    print(f"token by token against a window a forward: KL {kl:.3e}, top-1 agreement {100 * top1:.2f}%; "
          f"its KL to float {tokens.kl / whole.kl:.4f}x the window's", flush=True)


def whole_runs(method: str, out: Path, ids: torch.Tensor, base: Score, base_logp: torch.Tensor) -> None:
    for int8, head in ((False, False), (True, False), (False, True), (True, True)):
        model, linears, paths = quantized(out, head, int8)
        if int8 and not all(m._direct is not None and m._direct.int8_activations for m in linears):
            raise SystemExit(f"the int8-activation kernel does not run every linear here: {sorted(paths)}")
        with torch.inference_mode():
            got, _ = score(model, ids, base_logp)
        print(f"{method} 4-bit, {'int8' if int8 else 'bf16'} activations, {'int8' if head else 'float'} "
              f"lm_head ({', '.join(sorted(paths))}): "
              f"{got.describe()} ({got.ppl / base.ppl:.4f}x float)", flush=True)


def split_runs(method: str, out: Path, ids: torch.Tensor, base: Score, base_logp: torch.Tensor) -> None:
    """The three prompt / continuation arrangements, the int8 lm_head throughout (the engine's default), on one
    model whose linears run the rows named prompt rows W4A8 (EngineConfig.cpu_int8_prefill)."""
    model, linears, paths = quantized(out, head=True, int8=False, int8_prefill=True)
    if not all(m.prompt_q8 is not None for m in linears):
        raise SystemExit(f"the int8-activation kernel does not take every linear here: {sorted(paths)}")
    name = {False: "bf16", True: "int8"}
    for prompt, rest in ((False, False), (True, False), (True, True)):
        with torch.inference_mode():
            got, _ = score(model, ids, base_logp, split=(prompt, rest))
        print(f"{method} 4-bit, int8 lm_head, prompt in {name[prompt]} activations, continuation in {name[rest]}: "
              f"{got.describe()} ({got.ppl / base.ppl:.4f}x float)", flush=True)


if __name__ == "__main__":
    main()
