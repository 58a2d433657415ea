"""The embedded default: a small Llama trained on the project's own synthetic corpus, so
`quantkit demo` shows the whole flow (train -> quantize -> perplexity -> generate) on a fresh
offline machine. Shapes are chosen so every linear packs at group size 128."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.progress import progress_bar


@dataclass(frozen=True)
class DemoSpec:
    hidden: int = 128
    intermediate: int = 384
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    context: int = 256
    train_steps: int = 300  # about 70 s on the 2-core CI machine
    batch: int = 16
    seqlen: int = 128
    lr: float = 3e-3
    seed: int = 0
    train_stories: int = 20000
    heldout_stories: int = 600


@dataclass(frozen=True)
class TrainSchedule:
    """AdamW on random windows of a token stream: linear warm-up over `warmup` steps, then a
    linear decay to 10% of `lr`; gradients clipped to norm 1."""

    steps: int
    batch: int
    seqlen: int
    lr: float
    seed: int
    warmup: int = 30
    bf16: bool = False  # torch.autocast(bfloat16) for the forward pass


def train_steps(model, ids: torch.Tensor, sched: TrainSchedule, label: str, show_progress: bool = True,
                on_step=None) -> float:
    """Train `model` (a CausalLM) in place on windows of `ids` [T]; returns the last training loss.
    A fixed step count and a seeded generator: the result does not depend on the machine's load."""
    opt = torch.optim.AdamW(model.parameters(), lr=sched.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(sched.seed)
    loss = float("nan")
    model.train()
    with progress_bar(label, sched.steps, show_progress) as advance:
        for step in range(sched.steps):
            offs = torch.randint(0, ids.numel() - sched.seqlen - 1, (sched.batch,), generator=gen)
            batch = torch.stack([ids[o : o + sched.seqlen] for o in offs.tolist()])
            for group in opt.param_groups:
                group["lr"] = sched.lr * min(1.0, (step + 1) / sched.warmup) * (1 - 0.9 * step / sched.steps)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=sched.bf16):
                result = model(input_ids=batch, labels=batch)
            opt.zero_grad(set_to_none=True)
            result.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss = result.loss.item()
            if on_step is not None:
                on_step(step, loss)
            advance()
    model.eval()
    return loss


def corpus_text(num_stories: int, seed: int) -> str:
    from quantkit.calibration.synthetic import make_corpus

    return "\n\n".join(make_corpus(num_stories, seed))


def train_demo_model(out: Path, spec: DemoSpec = DemoSpec(), show_progress: bool = True) -> dict:
    """Train the demo Llama for `spec.train_steps` steps (a fixed count, so the result does not
    depend on the machine's load) and save it (model + tokenizer) to `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.calibration.synthetic import build_tokenizer

    torch.manual_seed(spec.seed)
    tok = build_tokenizer(vocab_size=spec.vocab, seed=spec.seed)
    ids = torch.tensor(tok(corpus_text(spec.train_stories, spec.seed), add_special_tokens=False,
                           verbose=False)["input_ids"])
    config = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                         num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.context,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    start = time.perf_counter()
    loss = train_steps(model, ids, TrainSchedule(spec.train_steps, spec.batch, spec.seqlen, spec.lr, spec.seed),
                       "train demo model", show_progress)
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return {"steps": spec.train_steps, "final_train_loss": loss,
            "train_tokens": spec.train_steps * spec.batch * spec.seqlen,
            "seconds": time.perf_counter() - start}
