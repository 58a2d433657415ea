"""A hand-made quantized checkpoint for interop checks, independent of `quantkit quantize`.

Takes a float checkpoint (one safetensors file, e.g. tests_support.tiny_models output), RTN-quantizes
every decoder linear with quantkit.format.primitives, packs it with quantkit.format.packing, leaves the
linears named in `keep_float` as plain float weights, and writes config.json with the
`quantization_config` that vLLM 0.32 reads (see /tmp/vllm_findings.md, copied into the Interop
section of docs/BENCHMARKS.md):
  gptq / gptq_v2: bits, group_size, sym, desc_act, checkpoint_format, and `dynamic` "-:" rules for
                  the float linears (vLLM matches them with re.match against its fused module names)
  awq:            bits, group_size, zero_point, version gemm, modules_to_not_convert
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from quantkit.format.packing import pack, packable
from quantkit.format.primitives import QuantScheme, rtn_quantize

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# vLLM fuses these linears into one module, and matches `dynamic` rules against the fused name.
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def vllm_names(modules: list[str]) -> list[str]:
    """HF module names plus the fused vLLM names they belong to, in order, without repeats."""
    out: list[str] = []
    for name in modules:
        parent, _, leaf = name.rpartition(".")
        for candidate in (name, f"{parent}.{FUSED[leaf]}" if leaf in FUSED else None):
            if candidate and candidate not in out:
                out.append(candidate)
    return out


def quantization_config(layout: str, scheme: QuantScheme, keep_float: list[str]) -> dict:
    """The config.json `quantization_config` for a layout, with `keep_float` linears left float."""
    if layout == "awq":
        return {"quant_method": "awq", "bits": scheme.bits, "group_size": scheme.group_size,
                "zero_point": not scheme.sym, "version": "gemm", "modules_to_not_convert": list(keep_float)}
    dynamic = {f"-:{re.escape(name)}$": {} for name in vllm_names(keep_float)}
    return {"quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size, "sym": scheme.sym,
            "desc_act": False, "checkpoint_format": layout, "lm_head": False, "dynamic": dynamic}


def write_rtn_checkpoint(src: Path, out: Path, layout: str, scheme: QuantScheme,
                         keep_float: list[str] = ()) -> Path:
    """RTN-quantize `src` into `out` in `layout` ("gptq", "gptq_v2" or "awq")."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        prefix = key.removesuffix(".weight")
        if key.endswith(".weight") and prefix.split(".", 3)[-1] in LINEARS and prefix not in keep_float:
            n, k = t.shape
            reason = packable(n, k, scheme, layout)
            if reason:
                raise ValueError(f"{prefix}: {reason}")
            tensors.update(pack(rtn_quantize(t, scheme), layout).tensors(prefix))
        else:
            tensors[key] = t.to(torch.float16)  # checkpoints store fp16 floats, like GPTQModel/AutoAWQ
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(layout, scheme, list(keep_float))
    config["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in src.iterdir():
        if name.name not in ("model.safetensors", "config.json") and name.is_file():
            shutil.copy(name, out / name.name)
    return out


def main(argv: list[str] | None = None) -> int:
    """Build a tiny random Llama (tests_support.tiny_models) and write RTN checkpoints of it."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="hand-made RTN checkpoints for the vLLM interop check")
    ap.add_argument("out", type=Path, help="folder; gets float/ and one folder per --layout")
    ap.add_argument("--layout", action="append", choices=("gptq", "gptq_v2", "awq"))
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--asym", action="store_true")
    ap.add_argument("--keep-float", action="append", default=None,
                    help="module left float (repeatable); default: layer 0's MLP")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tests_support
    from tests_support.tiny_models import make_tiny_model

    src = args.out / "float"
    if not (src / "model.safetensors").exists():
        make_tiny_model(src, family="llama")
    keep = args.keep_float if args.keep_float is not None else [
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    scheme = QuantScheme(bits=4, group_size=args.group_size, sym=not args.asym)
    for layout in args.layout or ["gptq"]:
        dst = args.out / f"{layout}-g{args.group_size}-{'asym' if args.asym else 'sym'}"
        write_rtn_checkpoint(src, dst, layout, scheme, keep)
        print(dst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
