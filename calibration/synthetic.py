"""A corpus the project generates itself, and a BPE tokenizer trained on it.

Used by `quantkit demo` (a small Llama trained for about a minute on this corpus, so the main
job runs on a fresh offline machine) and by tests that need a tokenizer without a download.
The stories come from a small seeded grammar: simple, repetitive English a tiny model can learn.
"""

from __future__ import annotations

import random

NAMES = ("Lily", "Tom", "Mia", "Ben", "Sara", "Max", "Anna", "Leo", "Zoe", "Sam")
ANIMALS = ("cat", "dog", "bird", "fox", "bunny", "frog", "duck", "bear")
OBJECTS = ("ball", "kite", "box", "hat", "book", "cake", "flower", "boat", "drum", "toy")
COLORS = ("red", "blue", "green", "yellow", "big", "small", "shiny", "soft")
PLACES = ("park", "garden", "forest", "beach", "house", "river", "school", "hill")
FEELINGS = ("happy", "sad", "excited", "scared", "tired", "proud", "surprised")
VERBS = ("play", "run", "sing", "dance", "jump", "read", "swim", "draw")

TEMPLATES = (
    "Once upon a time, there was a {feeling} {animal} named {name}. {name} liked to {verb} in the {place}.",
    "One day, {name} found a {color} {object} in the {place}. {name} was very {feeling}.",
    "{name} said, \"Can I {verb} with your {object}?\" The {animal} said, \"Yes, let's {verb} together!\"",
    "{name} and the {animal} went to the {place}. They saw a {color} {object} and wanted to {verb}.",
    "The {animal} was {feeling} because the {object} was lost. {name} helped look for it in the {place}.",
    "After they {verb_past} all day, {name} went home. {name} was {feeling} and went to sleep.",
    "Mom said, \"{name}, do not {verb} near the {place}.\" {name} listened and stayed {feeling}.",
    "The end. {name} learned that friends always share the {color} {object}.",
)

PAST = {"play": "played", "run": "ran", "sing": "sang", "dance": "danced", "jump": "jumped",
        "read": "read", "swim": "swam", "draw": "drew"}


def make_story(rng: random.Random, sentences: int = 6) -> str:
    slots = dict(name=rng.choice(NAMES), animal=rng.choice(ANIMALS), object=rng.choice(OBJECTS),
                 color=rng.choice(COLORS), place=rng.choice(PLACES), feeling=rng.choice(FEELINGS))
    out = []
    for _ in range(sentences):
        verb = rng.choice(VERBS)
        out.append(rng.choice(TEMPLATES).format(verb=verb, verb_past=PAST[verb], **slots))
        if rng.random() < 0.3:
            slots["feeling"] = rng.choice(FEELINGS)
        if rng.random() < 0.2:
            slots["object"] = rng.choice(OBJECTS)
    return " ".join(out)


def make_corpus(num_stories: int, seed: int = 0) -> list[str]:
    """`num_stories` stories (documents), deterministic for a seed."""
    rng = random.Random(seed)
    return [make_story(rng, rng.randint(3, 8)) for _ in range(num_stories)]


def build_tokenizer(vocab_size: int = 512, num_stories: int = 2000, seed: int = 0):
    """A byte-level BPE tokenizer (pad=0, bos=1, eos=2, BOS prepended) trained on the synthetic corpus."""
    return train_bpe_tokenizer(make_corpus(num_stories, seed), vocab_size)


def train_bpe_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer (pad=0, bos=1, eos=2, BOS prepended) trained on `texts` (an
    iterable of documents), as a PreTrainedTokenizerFast. Deterministic for the same texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token=None, model_max_length=4096)
