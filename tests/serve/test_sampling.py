"""n, seeds, logprobs and exact greedy tokens through /v1/completions (stories260K)."""

from __future__ import annotations

import httpx
import pytest
import torch


def completion(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": "stories", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(logprobs: dict) -> list[int]:
    return [int(t.split(":")[1]) for t in logprobs["tokens"]]


def test_greedy_tokens_equal_the_offline_engine(stories_server):
    from quantkit.engine import LLM, SamplingParams

    prompts = ["Once upon a time", "Tom had a red ball"]
    llm = LLM(stories_server.state.settings.engine.model, num_threads=1)
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    for prompt, ref in zip(prompts, refs):
        body = completion(stories_server.url, prompt=prompt, max_tokens=20, temperature=0, logprobs=0,
                          return_tokens_as_token_ids=True)
        assert token_ids(body["choices"][0]["logprobs"]) == ref.outputs[0].token_ids


def test_n3_with_a_seed_is_reproducible(stories_server):
    body = dict(prompt="Once upon a time", max_tokens=16, temperature=1.0, n=3, seed=1234)
    a = completion(stories_server.url, **body)
    b = completion(stories_server.url, **body)
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len({c["text"] for c in a["choices"]}) > 1  # three different samples
    c = completion(stories_server.url, **body, logprobs=0, return_tokens_as_token_ids=True)
    assert [x["text"] for x in c["choices"]] == [x["text"] for x in a["choices"]]
    assert c["usage"]["completion_tokens"] == sum(len(x["logprobs"]["tokens"]) for x in c["choices"])


def test_n3_streams_every_index_to_the_end(stories_server):
    import openai

    client = openai.OpenAI(base_url=f"{stories_server.url}/v1", api_key="x", max_retries=0, timeout=60)
    full = client.completions.create(model="stories", prompt="Once", max_tokens=10, temperature=1.0, n=3, seed=7)
    chunks = list(client.completions.create(model="stories", prompt="Once", max_tokens=10, temperature=1.0, n=3,
                                            seed=7, stream=True))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == [c.text for c in full.choices]
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finals) == [0, 1, 2]


def test_logprobs_match_a_log_softmax_of_the_model(stories_server):
    from quantkit.model.loader import load_model

    body = completion(stories_server.url, prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=3,
                      return_tokens_as_token_ids=True)
    lp = body["choices"][0]["logprobs"]
    prompt_ids = httpx.post(f"{stories_server.url}/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    out_ids = token_ids(lp)
    model, _ = load_model(stories_server.state.settings.engine.model)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out_ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)  # [12, vocab]: the distribution of each output
    for pos, tok in enumerate(out_ids):
        assert lp["token_logprobs"][pos] == pytest.approx(ref[pos, tok].item(), abs=1e-3)
        top3 = torch.topk(ref[pos], 3)
        got = {int(k.split(":")[1]): v for k, v in lp["top_logprobs"][pos].items()}
        for t, v in zip(top3.indices.tolist(), top3.values.tolist()):
            assert got[t] == pytest.approx(v, abs=1e-3)
        assert tok == int(top3.indices[0])  # greedy: the sampled token is the top one


def test_logprobs_past_20_is_400(stories_server):
    r = httpx.post(f"{stories_server.url}/v1/completions", json={"prompt": "Once", "logprobs": 21}, timeout=60)
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
