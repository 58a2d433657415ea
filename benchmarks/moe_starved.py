"""MoE experts with few calibration tokens: which statistics their GPTQ should use, measured.

  python benchmarks/moe_starved.py [MODEL] [--experts 8] [--top-k 2] [--prior-tokens 2048] [--threads 2]

No trained MoE is at hand, so the experts are real trained MLPs with their real inputs: each decoder
layer's MLP of MODEL (default: stories260K-hf) on the post-attention norm's output for wikitext2
windows, and a router simulated by `--experts` random directions with top-k choice, so that the
tokens an expert gets are a skewed subset of all tokens, as a router's are. For each count n of
routed calibration tokens, every (layer, expert) is quantized to 4 bits, per output channel, with:
  rtn     no statistics;
  routed  GPTQ on the Hessian of its n routed tokens (gate/up on x, down on act(gate x) * up x);
  all     GPTQ on the Hessian of every calibration token, routed or not (llm-compressor's
          "calibrate all experts");
  blend   GPTQ on (n H_routed + K H_prior) / (n + K): the routed tokens with K pseudo-tokens of a
          prior, the Hessian of an evenly strided sample of `--prior-tokens` of all the calibration
          tokens (K = the linear's input width): quantkit's rule (quant/moe_experts.py);
and scored by its output's relative squared error ||y_q - y||^2 / ||y||^2 on held-out tokens routed
to it (other windows). Printed: the mean over layers and experts, per n and method.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.format.primitives import QuantScheme, rtn_quantize
from quantkit.quant.gptq import GPTQOptions, accumulate_hessian, empty_hessian, gptq_quantize

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
METHODS = ("rtn", "routed", "all", "blend")
SCHEME = QuantScheme(4, -1, True)


@dataclass
class Expert:
    gate: torch.Tensor  # [I, H] fp32
    up: torch.Tensor
    down: torch.Tensor  # [H, I]

    def hidden(self, x: torch.Tensor, gate=None, up=None) -> torch.Tensor:
        g = x @ (self.gate if gate is None else gate).T
        return torch.nn.functional.silu(g) * (x @ (self.up if up is None else up).T)

    def out(self, x: torch.Tensor) -> torch.Tensor:
        return self.hidden(x) @ self.down.T


def hessian(x: torch.Tensor) -> torch.Tensor:
    """GPTQ's H [K, K] of the rows of x [n, K]."""
    return accumulate_hessian(empty_hessian(x.shape[1]), 0, x)[0]


def blend(h_routed: torch.Tensor, n: int, h_all: torch.Tensor) -> torch.Tensor:
    """(n H_routed + K H_all) / (n + K): K pseudo-tokens of the all-token Hessian as a prior."""
    k = h_all.shape[0]
    return (n * h_routed + k * h_all) / (n + k)


def quantize(w: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    """W [N, K] 4-bit per channel, dequantized: RTN without H, else GPTQ on H."""
    if h is None:
        return rtn_quantize(w, SCHEME).dequantize()
    return gptq_quantize(w, h, SCHEME, GPTQOptions()).weight.dequantize()


def quantize_expert(e: Expert, method: str, routed: torch.Tensor, all_x: torch.Tensor, prior: torch.Tensor) -> Expert:
    """The expert with gate/up then down quantized by `method` (see the module docstring); all_x: every
    calibration token, prior: the strided sample of them."""
    def stats(x_routed: torch.Tensor, x_all: torch.Tensor, x_prior: torch.Tensor) -> torch.Tensor | None:
        if method == "rtn":
            return None
        if method == "all":
            return hessian(x_all)
        h = hessian(x_routed)
        return h if method == "routed" else blend(h, x_routed.shape[0], hessian(x_prior))

    h = stats(routed, all_x, prior)
    gu = quantize(torch.cat([e.gate, e.up]), h)
    gate, up = gu.split(e.gate.shape[0])
    down = quantize(e.down, stats(*(e.hidden(t, gate, up) for t in (routed, all_x, prior))))
    return Expert(gate, up, down)


def relative_error(q: Expert, e: Expert, x: torch.Tensor) -> float:
    y = e.out(x)
    return float((q.out(x) - y).pow(2).sum() / y.pow(2).sum())


def routed_rows(x: torch.Tensor, directions: torch.Tensor, expert: int, top_k: int) -> torch.Tensor:
    """Rows of x [T, H] whose top-k simulated router scores (x . direction_e) include `expert`."""
    chosen = torch.topk(x @ directions.T, top_k, dim=-1).indices
    return (chosen == expert).any(dim=-1).nonzero().squeeze(-1)


def mlp_inputs(model_path: Path, windows: int, seqlen: int, seed: int) -> tuple[list[torch.Tensor], list[Expert]]:
    """Each layer's MLP input [windows * seqlen, H] on wikitext2 windows, and its MLP as an Expert."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.calibration.data import load_calibration

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_path))
    ids = load_calibration(str(SHARED / "wikitext2" / "valid.txt"), tok, windows, seqlen, seed).input_ids
    seen = [[] for _ in model.model.layers]
    hooks = [layer.mlp.register_forward_pre_hook(lambda _m, a, i=i: seen[i].append(a[0].reshape(-1, a[0].shape[-1])))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    experts = [Expert(layer.mlp.gate_proj.weight.detach(), layer.mlp.up_proj.weight.detach(),
                      layer.mlp.down_proj.weight.detach()) for layer in model.model.layers]
    return [torch.cat(s) for s in seen], experts


def run(model_path: Path, num_experts: int, top_k: int, prior_tokens: int, windows: int = 80, seqlen: int = 256,
        seed: int = 0) -> dict[int, dict[str, float]]:
    """Mean relative error per routed-token count and method (the module docstring's table)."""
    inputs, mlps = mlp_inputs(model_path, windows, seqlen, seed)
    calib_tokens = inputs[0].shape[0] * 4 // 5  # the last fifth of the windows is held out
    g = torch.Generator().manual_seed(seed)
    table = {n: {m: [] for m in METHODS} for n in COUNTS}
    for x, mlp in zip(inputs, mlps):
        directions = torch.nn.functional.normalize(torch.randn(num_experts, x.shape[1], generator=g), dim=-1)
        calib, held = x[:calib_tokens], x[calib_tokens:]
        prior = calib[::max(1, calib_tokens // prior_tokens)][:prior_tokens]
        for e in range(num_experts):
            pool = calib[routed_rows(calib, directions, e, top_k)]
            pool = pool[torch.randperm(pool.shape[0], generator=g)]
            test = held[routed_rows(held, directions, e, top_k)]
            for n in COUNTS:
                for m in METHODS:
                    table[n][m].append(relative_error(quantize_expert(mlp, m, pool[:n], calib, prior), mlp, test))
    return {n: {m: sum(v) / len(v) for m, v in row.items()} for n, row in table.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(SHARED / "stories260K-hf"))
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--prior-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    table = run(Path(args.model), args.experts, args.top_k, args.prior_tokens)
    print("| routed tokens | " + " | ".join(METHODS) + " |")
    print("|---" * (len(METHODS) + 1) + "|")
    for n, row in table.items():
        best = min(row.values())
        print(f"| {n} | " + " | ".join(f"**{v:.4f}**" if v == best else f"{v:.4f}" for v in row.values()) + " |")


if __name__ == "__main__":
    main()
