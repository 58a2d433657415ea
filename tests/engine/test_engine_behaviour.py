"""End-to-end engine behaviour on stories260K: seeded sampling, stop strings and tokens,
incremental detokenization, bad input, stats, and the KV sizing refusal."""

from __future__ import annotations

import pytest

from quantkit.engine import LLM, SamplingParams
from quantkit.engine.detokenizer import IncrementalDetokenizer, find_stop
from quantkit.errors import QuantkitError

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a bird"]


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), max_num_seqs=16, max_model_len=128)


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=20)
    alone = llm.generate([PROMPTS[0]], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20)  # unseeded neighbours
    batched = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, p, others])[1].outputs[0].token_ids
    assert alone == batched
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=99,
                                                             max_tokens=20))[0].outputs[0].token_ids
    assert other_seed != alone


def test_stop_string_cuts_text_exactly(llm):
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert "Lily" in free.text  # ", there was a little girl named Lily. She loved ..."
    cut = free.text.index("Lily")
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, stop=["Lily", "zzz"]))[0].outputs[0]
    assert out.text == free.text[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", "Lily")
    assert out.token_ids == free.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(free.token_ids)
    kept = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, stop=["Lily"],
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free.text[:cut + len("Lily")]


def test_stop_token_ids_max_tokens_and_ignore_eos(llm):
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    tok = free.token_ids[3]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tok]))[0].outputs[0]
    first = free.token_ids.index(tok)
    assert out.token_ids == free.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", tok)
    long = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))[0].outputs[0]
    n_prompt = len(llm.tokenizer(PROMPTS[0]).input_ids)
    assert long.finish_reason == "length" and len(long.token_ids) == 128 - n_prompt  # max_model_len reached


def test_incremental_text_equals_the_full_decode(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=5, max_tokens=30))
    tok = llm.tokenizer
    for o in outs:
        full = tok.decode(o.prompt_token_ids + o.outputs[0].token_ids, skip_special_tokens=True)
        assert full.endswith(o.outputs[0].text) and o.outputs[0].text


def test_detokenizer_never_splits_a_multibyte_character(stories_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(stories_dir))
    text = " héllo 日本語 ✓ ok"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text.split())  # byte-fallback pieces: several tokens per character
    prompt = tok("Say", add_special_tokens=True).input_ids
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    full = tok.decode(prompt + ids, skip_special_tokens=True)
    head = tok.decode(prompt, skip_special_tokens=True)
    assert "".join(deltas) == full[len(head):] and full[len(head):].endswith(text)
    assert deltas.count("") > 0  # it waited for characters to complete


def test_detokenizer_passes_over_ids_the_tokenizer_lacks(stories_dir):
    """Ids past the tokenizer's vocabulary (a padded embedding) decode to nothing: the same text as without them, and
    the window keeps only the ids that have text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(stories_dir))
    prompt = tok("Say", add_special_tokens=True).input_ids
    ids = tok(" once upon a time", add_special_tokens=False).input_ids
    mixed = [t for i in ids for t in (i, len(tok) + 7, 31999)]
    plain, padded = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
    want = "".join(plain.add(i) for i in ids)
    deltas = [padded.add(i) for i in mixed]
    assert "".join(deltas) == want and want.strip() == "once upon a time"
    assert padded.ids == plain.ids and all(i < len(tok) for i in padded.ids)


def test_find_stop_reports_the_earliest_completed_stop():
    assert find_stop("abc STOP def", 4, ["STOP"]) is None  # completed before the last 4 chars
    assert find_stop("abc STO", 3, ["STOP"]) is None
    assert find_stop("abc STOP", 1, ["STOP", "OP"]) == (4, "STOP")
    assert find_stop("xxOPyy", 6, ["OP", "yy"]) == (2, "OP")


def test_bad_prompts_fail_alone_and_the_rest_continue(llm):
    too_long = list(range(3, 3 + 200))  # 200 token ids > max_model_len 128
    outs = llm.generate(["Once upon a time", too_long, "", [1, 600]], SamplingParams(temperature=0, max_tokens=5))
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 5
    assert outs[1].error == "prompt has 200 tokens, more than max_model_len 128"
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].finished
    assert outs[2].error == "empty prompt"
    assert "outside the vocabulary" in outs[3].error


def test_stats_count_tokens_prefix_hits_and_latencies(stories_dir):
    llm = LLM(str(stories_dir), max_num_seqs=8, max_model_len=128)
    shared = list(range(10, 10 + 48))  # 3 full blocks
    prompts = [[1] + shared + [200 + i] for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    st = llm.engine.get_stats()
    assert st.prompt_tokens == 4 * 50 and st.generation_tokens == 24 and st.num_finished == 4
    assert st.prefix_cache_queries == 200 and st.prefix_cache_hits == 3 * 48  # all but the first hit 3 blocks
    assert st.time_to_first_token.count == 4 and st.inter_token_latency.count == 4 * 5
    assert st.finished_by_reason == {"stop": 0, "length": 4, "abort": 0, "error": 0}
    assert st.num_running == st.num_waiting == 0 and st.kv_usage == 0.0
    assert st.kv_capacity_tokens == llm.engine.kv_plan.capacity_tokens == 8 * 128


def test_kv_pool_too_small_is_refused_at_start_up_with_numbers(stories_dir):
    with pytest.raises(QuantkitError, match=r"KV pool too small: 3 blocks of 16 tokens \(48 tokens.*"
                                            r"max_model_len=128 \(needs 8 blocks"):
        LLM(str(stories_dir), max_model_len=128, num_kv_blocks=3)
    with pytest.raises(QuantkitError, match="KV pool too small"):
        LLM(str(stories_dir), max_model_len=512, kv_cache_memory=100_000)


def test_engine_config_and_model_limits_are_checked(stories_dir):
    with pytest.raises(QuantkitError, match="exceeds the model's max_position_embeddings 512"):
        LLM(str(stories_dir), max_model_len=4096)
    with pytest.raises(QuantkitError, match="max_num_seqs"):
        LLM(str(stories_dir), max_num_seqs=0)


def test_unsupported_architecture_is_refused(tmp_path, stories_dir):
    import json
    import shutil

    bad = tmp_path / "gpt2ish"
    shutil.copytree(stories_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantkitError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(bad))


def test_eos_ids_follow_hf_generate_precedence(tmp_path):
    import json
    from types import SimpleNamespace

    from quantkit.engine.loaded_model import eos_token_ids

    tok = SimpleNamespace(eos_token_id=9)
    assert eos_token_ids(tmp_path, None, tok) == {9}
    assert eos_token_ids(tmp_path, 2, tok) == {2}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    assert eos_token_ids(tmp_path, 2, tok) == {1, 2}


def test_detokenizer_keeps_special_tokens_when_asked(stories_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(stories_dir))
    prompt = tok("Say").input_ids
    eos = tok.eos_token_id
    assert IncrementalDetokenizer(tok, prompt).add(eos) == ""
    assert IncrementalDetokenizer(tok, prompt, skip_special_tokens=False).add(eos) == tok.eos_token
