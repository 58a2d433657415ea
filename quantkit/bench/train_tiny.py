"""Train the project's small GQA test model: a Llama trained on WikiText-2 valid.

  python -m quantkit.bench.train_tiny [--out DIR] [--steps 1600] [--bf16/--no-bf16] [--threads 2] [--force]
  python -m quantkit.bench.train_tiny --time-steps      # fp32 against bf16 autocast, one step each

Shapes as a user's GQA model (Llama 3, Mistral, Qwen2) in miniature: hidden 256, 6 layers,
8 query heads and 4 KV heads (head_dim 32), intermediate 768, separate lm_head; every linear
packs at group 128. The tokenizer is a byte-level BPE (vocab 1024) trained on the same text, so
nothing is downloaded. Training reads only `../shared/data/wikitext2/valid.txt` (test.txt is
kept for scoring): AdamW on random 256-token windows, a fixed step count and seeds, so two runs
on one machine give the same weights whatever the load.

1600 steps (about eight passes over the 0.42 M training tokens), because a less trained model
cannot rank 4-bit methods: at 400 steps (perplexity 66.6) asymmetric RTN lost 0.07% and GPTQ
landed below float; at 1600 steps (30.4) the methods part (docs/BENCHMARKS.md, the accuracy section). The default trains under torch.autocast(bfloat16) where the CPU computes
bf16 natively (AMD EPYC with AVX-512 BF16, 2 threads: 0.29 s a step, 458 s in all, loss 6.972 at
the first step and 2.741 over the last 20, test perplexity 30.353; fp32 1.47 s a step) and in fp32 elsewhere (there bf16 is emulated and slower: Intel Xeon Ice Lake, 2 threads,
10.9 s against 7.6 s a step), so the model differs between those two kinds of machine; each
benchmark compares both tools on the model of its machine.

The model goes to ~/.cache/quantkit/tiny-gqa-wikitext-s{steps} (or $QUANTKIT_TINY_GQA, or --out), written
to a temporary folder and renamed, with `train_meta.json` (steps, seconds, losses, perplexity on
the first 20,000 tokens of test.txt in 256-token windows). An existing model is reused unless
--force or the training settings differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
WIKITEXT = SHARED / "wikitext2"
PPL_TOKENS = 20_000
PPL_SEQLEN = 256


@dataclass(frozen=True)
class TinySpec:
    hidden: int = 256
    layers: int = 6
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 768
    vocab: int = 1024
    context: int = 256
    steps: int = 1600
    batch: int = 8
    seqlen: int = 256
    lr: float = 3e-3
    seed: int = 0
    bf16: bool = False
    tie: bool = False  # lm_head shares the embedding's weight
    tokenizer: str = "bpe"  # a key of TOKENIZERS

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer {self.tokenizer!r}: one of {', '.join(TOKENIZERS)}")
        fixed = TOKENIZERS[self.tokenizer]
        if fixed is not None and self.vocab != fixed:
            raise ValueError(f"tokenizer {self.tokenizer!r} has {fixed} tokens, not vocab={self.vocab}")
        if self.heads % self.kv_heads or self.hidden % self.heads:
            raise ValueError(f"heads {self.heads} must divide hidden {self.hidden}, kv_heads {self.kv_heads} divide heads")


# tokenizer name -> its fixed vocabulary size (None: a byte-level BPE trained on the text, of spec.vocab tokens)
TOKENIZERS: dict[str, int | None] = {"bpe": None, "stories": 512}


def default_spec() -> TinySpec:
    """The benchmarks' model: TinySpec's settings, trained under bf16 autocast where the CPU computes
    bf16 natively (quantkit.devices.auto_cpu_dtype), in fp32 elsewhere."""
    from quantkit.devices import auto_cpu_dtype

    return TinySpec(bf16=auto_cpu_dtype()[0] == "bfloat16")


def default_dir(spec: TinySpec = TinySpec()) -> Path:
    """The step count is in the name, so checkouts with different defaults keep their own models."""
    env = os.environ.get("QUANTKIT_TINY_GQA")
    return Path(env) if env else Path.home() / ".cache" / "quantkit" / f"tiny-gqa-wikitext-s{spec.steps}"


def cached_model(out: Path, spec: TinySpec) -> Path | None:
    """`out` when it holds a model trained with exactly `spec`, else None."""
    meta = out / "train_meta.json"
    if not meta.is_file():
        return None
    stored = json.loads(meta.read_text()).get("spec") or {}
    # settings added after a model was trained take their defaults, so older caches stay valid
    return out if {**asdict(TinySpec()), **stored} == asdict(spec) else None


def test_ppl(model, tok, tokens: int = PPL_TOKENS, seqlen: int = PPL_SEQLEN) -> float:
    """Perplexity on the first `tokens` tokens of wikitext2/test.txt in `seqlen`-token windows."""
    from quantkit.eval.perplexity import perplexity, tokenize_once

    ids, note = tokenize_once(tok, (WIKITEXT / "test.txt").read_text(encoding="utf-8"))
    return perplexity(model.eval(), ids[:tokens], seqlen, "wikitext2/test.txt", note).ppl


def new_model(spec: TinySpec):
    """The untrained LlamaForCausalLM of `spec`, initialised from spec.seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    config = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                         num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.context,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=spec.tie)
    return LlamaForCausalLM(config)


def new_tokenizer(spec: TinySpec, docs: list[str]):
    """A byte-level BPE of spec.vocab tokens trained on `docs`, or stories260K-hf's own (sentencepiece) tokenizer."""
    if spec.tokenizer == "stories":
        from quantkit.model.loader import load_tokenizer

        return load_tokenizer(SHARED / "stories260K-hf")
    from quantkit.calibration.synthetic import train_bpe_tokenizer

    return train_bpe_tokenizer(docs, spec.vocab)


def train(out: Path, spec: TinySpec = TinySpec(), show_progress: bool = True) -> dict:
    """Train and save the model (and tokenizer, and train_meta.json) into `out`."""
    from quantkit.calibration.data import split_text_documents
    from quantkit.demo import TrainSchedule, train_steps

    valid = (WIKITEXT / "valid.txt").read_text(encoding="utf-8")
    docs = split_text_documents(valid)
    tok = new_tokenizer(spec, docs)
    ids = torch.tensor(tok("\n\n".join(docs), add_special_tokens=False, verbose=False)["input_ids"])
    model = new_model(spec)
    losses: list[float] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    sched = TrainSchedule(spec.steps, spec.batch, spec.seqlen, spec.lr, spec.seed, bf16=spec.bf16)
    train_steps(model, ids, sched, f"train {out.name}", show_progress, on_step=lambda _s, loss: losses.append(loss))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tail = losses[-20:]
    meta = {"spec": asdict(spec), "train_tokens": len(ids), "seconds": round(seconds, 1),
            # CPU seconds of all threads: on a loaded machine, cpu_seconds / threads approximates an idle one's wall time
            "cpu_seconds": round(cpu_seconds, 1),
            "threads": torch.get_num_threads(), "load_avg": round(os.getloadavg()[0], 2),
            "first_loss": round(losses[0], 4), "last20_mean_loss": round(sum(tail) / len(tail), 4),
            "test_ppl_20k_256": round(test_ppl(model, tok), 3)}
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return meta


def step_seconds(spec: TinySpec, bf16: bool, steps: int = 4) -> float:
    """Median seconds of one training step of the untrained model on random tokens, fp32 or bf16
    autocast (the first step is dropped as warm-up)."""
    model = new_model(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    batch = torch.randint(0, spec.vocab, (spec.batch, spec.seqlen))
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def ensure_model(out: Path | None = None, spec: TinySpec = TinySpec(), show_progress: bool = True) -> Path:
    """The cached model for `spec`, training it first when absent."""
    out = out or default_dir(spec)
    if cached_model(out, spec) is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        train(out, spec, show_progress)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="default: $QUANTKIT_TINY_GQA or ~/.cache/quantkit/tiny-gqa-wikitext-s{steps}")
    ap.add_argument("--steps", type=int, default=TinySpec.steps)
    ap.add_argument("--seed", type=int, default=TinySpec.seed)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="train under bf16 autocast (default: where the CPU computes bf16 natively; slower elsewhere)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="train even when a model with these settings is cached")
    ap.add_argument("--time-steps", action="store_true",
                    help="only time a training step in fp32 and under bf16 autocast, train nothing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.time_steps:
        fp32, bf16 = step_seconds(TinySpec(), False), step_seconds(TinySpec(), True)
        print(f"step seconds, {args.threads} threads, load {os.getloadavg()[0]:.2f}: fp32 {fp32:.3f}, "
              f"bf16 autocast {bf16:.3f} ({bf16 / fp32:.2f}x)")
        return
    bf16 = default_spec().bf16 if args.bf16 is None else args.bf16
    spec = TinySpec(steps=args.steps, seed=args.seed, bf16=bf16)
    out = args.out or default_dir(spec)
    if args.force or cached_model(out, spec) is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        train(out, spec)
    print(f"{out}: {(out / 'train_meta.json').read_text()}")


if __name__ == "__main__":
    main()
