"""Structured outputs (quantkit.engine.structured_outputs): the mask, not the model, makes the output valid. On
stories260K-hf, a model that writes children's stories and knows nothing of JSON, every output matches its schema,
regex, choice or grammar, greedy and sampled, with n > 1, under preemption; a spec that does not compile is refused
when the request is added; the mask forbids exactly what the grammar forbids."""

from __future__ import annotations

import json
import re

import pytest
import torch

from quantkit.engine import LLM, SamplingParams, StructuredOutputsParams
from quantkit.errors import QuantkitError

SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Lily", "Tom", "Ben"]}, "happy": {"type": "boolean"},
                                           "age": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["name", "happy", "age"], "additionalProperties": False}
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day"]


def matches_schema(text: str) -> bool:
    value = json.loads(text)
    return (list(value) == ["name", "happy", "age"] and value["name"] in ("Lily", "Tom", "Ben")
            and isinstance(value["happy"], bool) and isinstance(value["age"], int) and 1 <= value["age"] <= 9)


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), max_model_len=256, max_num_seqs=8)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_parse_and_match_in_the_schemas_key_order(llm, temperature):
    spec = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(temperature=temperature, seed=3, n=3, max_tokens=60, structured_outputs=spec)
    for out in llm.generate(PROMPTS, params):
        for c in out.outputs:
            assert c.finish_reason == "stop" and matches_schema(c.text), c.text


def test_free_text_is_not_json(llm):
    """The control: the same prompts without a spec are stories, so the mask above did the work."""
    for out in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30)):
        with pytest.raises(ValueError):
            json.loads(out.outputs[0].text)


@pytest.mark.parametrize("spec,check", [
    (StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
    (StructuredOutputsParams(choice=["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
    (StructuredOutputsParams(grammar='root ::= "yes" | "no" | "maybe " [0-9]'),  # llama.cpp's GBNF
     lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
    (StructuredOutputsParams(grammar='start: "x" /[0-9]{1,3}/ "!"'),  # Lark
     lambda t: re.fullmatch(r"x[0-9]{1,3}!", t)),
    (StructuredOutputsParams(json_object=True), lambda t: t.startswith("{")),
])
def test_regex_choice_grammars_and_json_object(llm, spec, check):
    params = SamplingParams(temperature=1.0, seed=0, n=2, max_tokens=40, structured_outputs=spec)
    for out in llm.generate(PROMPTS[:2], params):
        for c in out.outputs:
            if spec.json_object and c.finish_reason == "length":
                continue  # any object: a story inside one string may outrun max_tokens
            assert check(c.text), (spec.kind, c.text)


def test_outputs_stay_valid_when_requests_are_preempted(stories_dir):
    tight = LLM(str(stories_dir), max_model_len=128, max_num_seqs=8, num_kv_blocks=9)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = tight.generate(PROMPTS * 3, params)
    assert tight.engine.get_stats().num_preemptions_total > 0
    assert all(matches_schema(o.outputs[0].text) for o in outs)


@pytest.mark.parametrize("spec,words", [
    (StructuredOutputsParams(regex="[a-z"), "regex"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar"),
])
def test_a_spec_that_does_not_compile_is_refused_at_add_request(llm, spec, words):
    with pytest.raises(QuantkitError, match=f"structured outputs.*{words}"):
        llm.engine.add_request("Once", SamplingParams(structured_outputs=spec), reject_bad_prompt=True)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs,words", [({}, "exactly one"), ({"json": "{not json"}, "not JSON"),
                                          ({"regex": "a", "choice": ["b"]}, "exactly one"),
                                          ({"choice": []}, "non-empty"), ({"json": "[1]"}, "is an object")])
def test_a_malformed_spec_is_one_line(kwargs, words):
    with pytest.raises(QuantkitError, match=words):
        StructuredOutputsParams(**kwargs)


def test_the_mask_forbids_exactly_what_the_matcher_refuses(llm):
    """The masked logits are -inf on a token if and only if the grammar's matcher would not consume it."""
    import llguidance

    grammars = llm.engine.grammars
    spec = StructuredOutputsParams(choice=["Lily", "Lucy", "Tom"])
    logits = torch.randn(1, llm.engine.model.shape.vocab_size)
    masked = grammars.masked(logits, ["probe"], [spec])
    template = grammars.compile(spec)
    allowed = [t for t in range(logits.shape[1]) if template.deep_copy().try_consume_tokens([t]) == 1]
    assert allowed and torch.isfinite(masked[0]).nonzero().flatten().tolist() == allowed
    assert torch.equal(masked[0, allowed], logits[0, allowed])
    grammars.release("probe")
    assert isinstance(template, llguidance.LLMatcher)


def test_mask_bias_reads_the_bitmask_little_endian_word_by_word():
    from quantkit.engine.structured_outputs import mask_bias

    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=g)
    vocab = 150  # not a multiple of 32: the last word's high bits are past the vocabulary
    want = torch.tensor([[0.0 if (int(bitmask[b, t // 32]) >> (t % 32)) & 1 else float("-inf") for t in range(vocab)]
                         for b in range(3)])
    assert torch.equal(mask_bias(bitmask, vocab), want)
