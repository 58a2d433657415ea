"""A random tiny Llama (transformers' LlamaConfig) with a real tokenizer (stories260K's Llama 2 SentencePiece BPE) and
a chat template that writes the tools, for the structured-output and tool-calling tests: a model that knows nothing,
so whatever shape its output has, the mask gave it."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

# Tools as a system line, earlier calls and tool answers as Hermes writes them.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>You may call: {{ tools | tojson }}\n{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_random_llama(out: Path, tokenizer_dir: Path, vocab: int = 512, seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return Path(out)
